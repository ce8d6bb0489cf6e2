"""Operator settings: what a cluster admin owns (default image, GPU type placement, timings).

Loaded from a YAML file (``polyrl operator --settings FILE``), typically a ConfigMap mounted into the
operator's pod. Everything has a default so ``polyrl render`` and tests work with no file. A GPU type
with no mapping becomes the node selector ``polyrl.dev/gpu-type: <name>`` (admins label nodes), so a
new type works without touching the operator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from polyrl_operator.kinds import ChildKind, enabled
from polyrl_operator.roles import ROLES

GPU_TYPE_LABEL = "polyrl.dev/gpu-type"
GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_OPERATOR_NAMESPACE = "polyrl-system"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class Placement(_Model):
    """Where pods of one GPU type go: merged into the pod spec before the role's podTemplate."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None


class Autoscale(_Model):
    """Rollout/workflow autoscaling from the coordinator's /progress, with hysteresis.

    Scale out when the backlog per ready replica stays above ``backlog_high`` for ``out_window``
    seconds; scale in (one replica at a time, drained) when there is no backlog and mean utilisation
    stays below ``utilisation_low`` for ``in_window`` seconds; nothing changes for ``cooldown``
    seconds after a change. The gap between the two thresholds and the windows is the hysteresis.
    """

    backlog_high: float = 4.0
    utilisation_low: float = 0.3
    out_window: float = 30.0
    in_window: float = 120.0
    cooldown: float = 60.0


class Kueue(_Model):
    """Kueue integration. On: a job with ``scheduling.queueName`` gets one Kueue Workload and waits
    for its admission. Off: the operator neither watches nor creates Workloads (and needs no RBAC for
    them); a job that names a queue is rejected (InvalidSpec) instead of silently bypassing quota."""

    enabled: bool = True


class LeaderElection(_Model):
    """Leader election on a coordination.k8s.io Lease (``polyrl_operator.leader``): with it on, only
    the replica holding the Lease runs the handlers, so a Deployment may run several replicas."""

    enabled: bool = False
    lease_name: str = "polyrl-operator"
    lease_namespace: str | None = None
    """Default: the operator's own namespace (``POD_NAMESPACE``)."""
    lease_duration: float = Field(15.0, gt=0)
    """Seconds a standby waits after the leader's last renewal before it takes the Lease."""
    renew_deadline: float = Field(10.0, gt=0)
    """The leader stops when it could not renew for this long (less than leaseDuration)."""
    retry_period: float = Field(2.0, gt=0)
    """Seconds between a standby's tries and between the leader's renewals."""

    @model_validator(mode="after")
    def _ordered(self) -> LeaderElection:
        if not self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("leaderElection needs retryPeriod < renewDeadline < leaseDuration")
        return self


class NetworkPolicySettings(_Model):
    """The per-job NetworkPolicies: job pods accept traffic only from pods of the same job, plus the
    coordinator's progress port (8000) from the operator's pods. Egress is not restricted."""

    enabled: bool = True
    operator_namespace: str | None = None
    """Namespace of the operator's pods; None: the operator's own namespace (``POD_NAMESPACE``,
    from the downward API), else ``polyrl-system``."""
    operator_pod_labels: dict[str, str] = Field(
        default_factory=lambda: {"app.kubernetes.io/name": "polyrl-operator"}
    )
    """Labels that select the operator's pods (must match the operator Deployment's pod labels)."""
    extra_ingress: list[dict[str, Any]] = Field(default_factory=list)
    """More NetworkPolicy ingress rules for every job pod (e.g. a Prometheus namespace)."""

    def namespace(self) -> str:
        return self.operator_namespace or DEFAULT_OPERATOR_NAMESPACE


class PodSecurity(_Model):
    """The security context of every job pod (restricted Pod Security Standard). Roles run as this
    non-root UID whatever the image's USER is; podTemplate overrides may change it per role."""

    run_as_user: int = 10001
    run_as_group: int = 10001
    fs_group: int = 10001
    read_only_root_filesystem: dict[str, bool] = Field(
        default_factory=lambda: {str(role): True for role in ROLES}
    )
    """Per role. Every pod gets a writable ``emptyDir`` at /tmp with the runtime's scratch and cache
    directories pointed there (TMPDIR, XDG_CACHE_HOME, TRITON_CACHE_DIR, TORCH_EXTENSIONS_DIR), so
    every built-in role runs with a read-only root; set a role to false when its user code
    (workflows, custom images) writes elsewhere."""


class OperatorSettings(_Model):
    """All operator settings; every field has a default."""

    default_image: str | None = "ghcr.io/polyrl/polyrl-runtime:0.1.0"
    image_pull_policy: str | None = None
    gpu_types: dict[str, Placement] = Field(default_factory=dict)
    strict_gpu_types: bool = False
    """Reject (InvalidSpec) a gpuType with no mapping instead of using the default node label."""
    runtime_command: list[str] = Field(default_factory=lambda: ["polyrl-runtime"])
    resync_seconds: float = 30.0
    """Every job is reconciled at least this often (the periodic timer)."""
    progress_interval: float = 10.0
    """Read a running job's /progress at most this often."""
    progress_timeout: float = 3.0
    progress_url: str = "http://{service}.{namespace}.svc:{port}"
    """Base URL of a job's coordinator; {job}, {namespace}, {service}, {port} are filled in."""
    drain_timeout: float = 300.0
    checkpoint_timeout: float = 600.0
    quota_backoff: float = 10.0
    quota_backoff_max: float = 300.0
    error_backoff: float = 2.0
    error_backoff_max: float = 120.0
    max_concurrent_reconciles: int = 16
    max_concurrent_writes: int = 8
    """Writes in flight per reconcile (pods of one job are created in parallel up to this)."""
    autoscale: Autoscale = Field(default_factory=Autoscale)
    metrics_port: int | None = 9090
    liveness_port: int | None = 8080
    kueue: Kueue = Field(default_factory=Kueue)
    network_policy: NetworkPolicySettings = Field(default_factory=NetworkPolicySettings)
    pod_security: PodSecurity = Field(default_factory=PodSecurity)
    leader_election: LeaderElection = Field(default_factory=LeaderElection)

    def child_kinds(self) -> tuple[str, ...]:
        """The kinds of children the operator creates, watches and cleans up with these settings."""
        return tuple(k.kind for k in self.child_kind_rows())

    def child_kind_rows(self) -> tuple[ChildKind, ...]:
        """The rows of the child-kind table these settings turn on."""
        return enabled({"networkPolicy": self.network_policy.enabled, "kueue": self.kueue.enabled})

    def placement(self, gpu_type: str | None) -> Placement:
        """Placement for a role's gpuType; unmapped names select nodes labelled with the name."""
        if gpu_type is None:
            return Placement()
        mapped = self.gpu_types.get(gpu_type)
        if mapped is not None:
            return mapped
        return Placement(node_selector={GPU_TYPE_LABEL: gpu_type})


def load_settings(path: Path | None) -> OperatorSettings:
    """Settings from a YAML file (camelCase or snake_case keys), or the defaults."""
    if path is None:
        return OperatorSettings()
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: settings must be a YAML mapping")
    return OperatorSettings.model_validate(data)
