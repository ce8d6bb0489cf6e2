"""Building blocks shared by several roles: replica ranges, resources, env, pod template overrides."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StringConstraints, WithJsonSchema

from polyrl_operator.api.base import ApiModel, Rule

# A Kubernetes resource quantity ("500m", "4Gi", 2). Kubernetes models these as int-or-string with
# the canonical quantity pattern on the string form; we accept exactly what the API server accepts.
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
Quantity = Annotated[
    int | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN)],
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
        }
    ),
]

DNS_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""RFC 1035 label: what Service names require (a pod name component must also be one)."""

ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"


class Replicas(ApiModel):
    """An elastic replica range. The operator chooses the current count between min and max
    (recorded in status, never in spec, so GitOps tools see no drift)."""

    __rules__ = (
        Rule(
            cel="self.min <= self.max",
            message="must be less than or equal to max",
            check=lambda r: r.min <= r.max,
            field=".min",
        ),
    )

    min: int = Field(
        1, ge=1, le=1000, description="Fewest replicas; the job needs at least this many to run."
    )
    max: int = Field(1, ge=1, le=1000, description="Most replicas the autoscaler may create.")


class ResourceRequirements(ApiModel):
    """Compute resources for one container, as in a Pod's ``resources``. GPUs are set by the role's
    ``gpus`` field, not here."""

    requests: dict[str, Quantity] | None = Field(
        None, description="Minimum resources the scheduler reserves, e.g. {cpu: 4, memory: 32Gi}."
    )
    limits: dict[str, Quantity] | None = Field(None, description="Hard caps, e.g. {memory: 64Gi}.")


class EnvVar(ApiModel):
    """An environment variable for the role's container (plain value or valueFrom a secret/config map)."""

    name: str = Field(
        ..., min_length=1, max_length=253, pattern=ENV_NAME_PATTERN, description="Variable name."
    )
    value: str | None = Field(None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        None,
        description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...), passed through.",
    )


class PodTemplateMetadata(ApiModel):
    """Labels and annotations added to the role's pods."""

    labels: dict[str, str] | None = Field(None, description="Extra pod labels (polyrl.dev/* are reserved).")
    annotations: dict[str, str] | None = Field(None, description="Extra pod annotations.")


class PodTemplateOverride(ApiModel):
    """A partial pod template merged over what the operator generates for this role: use it for
    volumes, volumeMounts (via containers[name=main]), nodeSelector, tolerations, affinity,
    serviceAccountName, securityContext and anything else a PodSpec has."""

    metadata: PodTemplateMetadata | None = Field(None, description="Labels and annotations for the pods.")
    spec: dict[str, Any] | None = Field(
        None,
        description="Partial Kubernetes PodSpec, strategic-merged over the generated one "
        "(the role's container is named 'main').",
    )


class RoleOverrides(ApiModel):
    """Per-role settings that every role (coordinator, workflow, rollout, trainer) accepts."""

    image: str | None = Field(
        None, max_length=512, description="Container image for this role; defaults to spec.image."
    )
    resources: ResourceRequirements | None = Field(None, description="CPU/memory requests and limits.")
    env: list[EnvVar] | None = Field(
        None, max_length=128, description="Extra environment variables for this role's container."
    )
    pod_template: PodTemplateOverride | None = Field(
        None, description="Overrides merged into the generated pod (volumes, tolerations, ...)."
    )
