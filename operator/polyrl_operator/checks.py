"""The operator's own checks: what passes the CRD but cannot run, reported as InvalidSpec.

An RLJob failing these is set to phase Failed with reason InvalidSpec and a message naming the field;
the operator creates nothing for it and does not retry until the spec changes (a new generation).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from polyrl_operator import naming
from polyrl_operator.api import RLJob, RoleOverrides
from polyrl_operator.builders.pods import role_image
from polyrl_operator.builders.workload import MAX_PODSETS
from polyrl_operator.roles import role_slots
from polyrl_operator.settings import OperatorSettings
from polyrl_operator.validation import explain

Problem = tuple[str, str]


def parse_job(body: dict[str, Any]) -> tuple[RLJob | None, list[Problem]]:
    """The RLJob model of a live object (status ignored: it is the operator's, not the user's)."""
    meta = body.get("metadata") or {}
    doc = {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
        "spec": body.get("spec"),
    }
    try:
        return RLJob.model_validate(doc), []
    except ValidationError as exc:
        return None, explain(exc)


def _role_checks(path: str, overrides: RoleOverrides, problems: list[Problem]) -> None:
    template = overrides.pod_template
    if template is None:
        return
    if template.metadata is not None:
        for key in template.metadata.labels or {}:
            if key.startswith(naming.DOMAIN + "/") or key == naming.LABEL_MANAGED_BY:
                problems.append(
                    (f"{path}.podTemplate.metadata.labels", f"label {key!r} is reserved for the operator")
                )
    spec = template.spec or {}
    restart = spec.get("restartPolicy")
    if restart not in (None, "Never"):
        problems.append(
            (
                f"{path}.podTemplate.spec.restartPolicy",
                f"must be unset or Never (got {restart!r}): the operator replaces and restarts pods itself",
            )
        )
    for i, container in enumerate(spec.get("containers") or []):
        if not isinstance(container, dict) or not container.get("name"):
            problems.append((f"{path}.podTemplate.spec.containers[{i}].name", "required field is missing"))


def operator_checks(job: RLJob, settings: OperatorSettings) -> list[Problem]:
    problems: list[Problem] = []
    spec = job.spec
    name = job.metadata.name
    longest, size = naming.longest_child_name(
        name, [p.name for p in spec.policies], spec.workflow.replicas.max, sorted(spec.pool_names)
    )
    if size > naming.MAX_NAME:
        problems.append(
            (
                "metadata.name",
                f"too long: child object {longest!r} would have {size} characters (at most {naming.MAX_NAME})",
            )
        )
    slots = role_slots(job)
    for slot in slots:
        gpu_type = slot.gpu_type
        if settings.strict_gpu_types and gpu_type and gpu_type not in settings.gpu_types:
            known = ", ".join(sorted(settings.gpu_types)) or "none"
            problems.append(
                (f"{slot.path}.gpuType", f"unknown GPU type {gpu_type!r} (this cluster maps: {known})")
            )
    for slot in slots:
        if role_image(job, slot.role, slot.owner, settings) is None:
            problems.append(
                (
                    f"{slot.path}.image",
                    "no image: set spec.image or the role's image (the operator has no default)",
                )
            )
        _role_checks(slot.path, slot.overrides, problems)
    if spec.scheduling and spec.scheduling.queue_name and not settings.kueue.enabled:
        problems.append(
            (
                "spec.scheduling.queueName",
                "this operator's Kueue integration is off (operator settings kueue.enabled): "
                "remove queueName, or ask the cluster admin to turn it on",
            )
        )
    elif spec.scheduling and spec.scheduling.queue_name:
        podsets = len(slots)
        pools = f" and {len(spec.pools)} pools" if spec.pools else ""
        if podsets > MAX_PODSETS:
            problems.append(
                (
                    "spec.policies",
                    f"{len(spec.policies)} policies{pools} need {podsets} Kueue podSets (one per "
                    "dedicated rollout or trainer, one per pool); a Workload allows "
                    f"{MAX_PODSETS} (at most {(MAX_PODSETS - 2) // 2} policies with dedicated roles and "
                    "scheduling.queueName; placing roles on pools takes fewer)",
                )
            )
    return problems


def queue_label_problems(job: RLJob, labels: dict[str, str], settings: OperatorSettings) -> list[Problem]:
    """A ``kueue.x-k8s.io/queue-name`` label with this operator's Kueue integration off: the job
    would bypass the queue its owner chose, so it is rejected, naming the label."""
    named_in_spec = job.spec.scheduling is not None and job.spec.scheduling.queue_name
    if settings.kueue.enabled or named_in_spec or not labels.get(naming.LABEL_KUEUE_QUEUE):
        return []
    return [
        (
            f"metadata.labels.{naming.LABEL_KUEUE_QUEUE}",
            "this operator's Kueue integration is off (operator settings kueue.enabled): "
            "remove the label, or ask the cluster admin to turn it on",
        )
    ]


def format_problems(problems: list[Problem]) -> str:
    return "; ".join(f"{path}: {message}" if path else message for path, message in problems)
