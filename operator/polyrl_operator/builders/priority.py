"""A job's priority (``spec.scheduling.priorityClassName``) as values: the rule Kueue resolves it by,
and where it lands on the Workload and on the pods.

Kueue resolves a Workload's priority from a ``WorkloadPriorityClass`` of that name first, then from a
``scheduling.k8s.io`` ``PriorityClass``. Only a PriorityClass means something to the kube-scheduler
(and the pod admission refuses a pod naming a class that is not one), so pods name the class only
when it is a PriorityClass. A job without a queue is not Kueue's: its pods name the field as written,
as Kubernetes users expect of a PriorityClass. Reading the classes is the reconciler's
(``polyrl_operator.priority``); everything here is pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polyrl_operator.api import RLJob
from polyrl_operator.kinds import KUEUE_GROUP

WORKLOAD_PRIORITY_CLASS = "WorkloadPriorityClass"
POD_PRIORITY_CLASS = "PriorityClass"
PRIORITY_GROUPS = {WORKLOAD_PRIORITY_CLASS: KUEUE_GROUP, POD_PRIORITY_CLASS: "scheduling.k8s.io"}
PRIORITY_FIELD = "spec.scheduling.priorityClassName"


@dataclass(frozen=True)
class Priority:
    """A job's priority: the class that gave it, and its value."""

    name: str
    kind: str  # WORKLOAD_PRIORITY_CLASS or POD_PRIORITY_CLASS
    value: int

    @property
    def pod_priority_class_name(self) -> str | None:
        """What the job's pods name: only a PriorityClass is a pod priority class; a
        WorkloadPriorityClass orders admission in Kueue and nothing else."""
        return self.name if self.kind == POD_PRIORITY_CLASS else None

    def workload_ref(self) -> dict[str, Any]:
        """The Workload's (kueue.x-k8s.io/v1beta2) ``priorityClassRef``."""
        return {"group": PRIORITY_GROUPS[self.kind], "kind": self.kind, "name": self.name}

    def workload_fields(self) -> dict[str, Any]:
        """The Workload's ``priorityClassRef`` and ``priority``."""
        return {"priorityClassRef": self.workload_ref(), "priority": self.value}


@dataclass(frozen=True)
class PriorityNotFound:
    """Neither kind of class has the name: the job cannot be admitted with it."""

    name: str

    @property
    def message(self) -> str:
        return (
            f"{PRIORITY_FIELD}: no WorkloadPriorityClass ({KUEUE_GROUP}) or PriorityClass "
            f"(scheduling.k8s.io) named {self.name!r}"
        )


def resolve_priority(
    name: str | None, workload_classes: Mapping[str, int], pod_classes: Mapping[str, int]
) -> Priority | PriorityNotFound | None:
    """Kueue's order: a WorkloadPriorityClass of that name first, then a PriorityClass.

    ``workload_classes`` / ``pod_classes`` map the classes that exist (as looked up) to their
    ``value``. ``None``: the job names no class (Kueue then uses its default, not ours to set)."""
    if not name:
        return None
    if name in workload_classes:
        return Priority(name, WORKLOAD_PRIORITY_CLASS, workload_classes[name])
    if name in pod_classes:
        return Priority(name, POD_PRIORITY_CLASS, pod_classes[name])
    return PriorityNotFound(name)


def recorded_priority(workload_priority: tuple[str, str, int] | None, name: str) -> Priority | None:
    """The priority a Workload already carries, as (kind, class name, value), when it is ``name``'s:
    the class was resolved when the Workload was made, and Kueue keeps that resolution (a class
    deleted or changed later does not move a Workload that exists)."""
    if workload_priority is None:
        return None
    kind, cls, value = workload_priority
    return Priority(cls, kind, value) if cls == name and kind in PRIORITY_GROUPS else None


def pod_priority_class(job: RLJob, priority: Priority | None) -> str | None:
    """The pods' ``priorityClassName``. A job with a queue: the resolved class, only when it is a
    PriorityClass. A job without one: the field as written (the pod admission checks it)."""
    scheduling = job.spec.scheduling
    if scheduling is None:
        return None
    if scheduling.queue_name:
        return priority.pod_priority_class_name if priority is not None else None
    return scheduling.priority_class_name or None
