"""The Kueue Workload that admits the whole job as one unit (kueue.x-k8s.io/v1beta2).

One podSet per role slot: ``coordinator``, ``workflow``, ``<policy>-rollout``/``<policy>-trainer`` for
a policy's roles on pods of their own, and ``<pool>-pool`` for each device pool (the pods of the
roles placed on it; its template is pod 0's, which hosts every one of them).
Elastic roles ask for their *maximum* count, so an admitted job can scale out to max without
exceeding what Kueue reserved; if Kueue admits fewer (partial admission), the assignment's count caps
the autoscaler. No Kueue controller runs in the tests: they write ``status.admission`` themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polyrl_operator import naming
from polyrl_operator.api import RLJob
from polyrl_operator.builders.common import JobRef, Manifest, metadata, stamp_hash
from polyrl_operator.builders.pods import PodRequest, build_pod
from polyrl_operator.builders.priority import Priority
from polyrl_operator.kinds import KUEUE_API_VERSION
from polyrl_operator.roles import Role, role_slots
from polyrl_operator.settings import OperatorSettings, Placement

MAX_PODSETS = 8 + 2 * 5
"""Kueue's Workload CRD allows at most 18 podSets: coordinator + workflow + 2 per policy => 8 policies
with dedicated roles (a pool's podSet stands for every role placed on it)."""


@dataclass(frozen=True)
class PodSetSize:
    name: str
    role: Role
    policy: str | None
    count: int
    pool: str | None = None

    @property
    def owner(self) -> str | None:
        return self.pool or self.policy


def podset_sizes(job: RLJob) -> list[PodSetSize]:
    """One podSet per role slot, at its maximum count (an elastic role may scale out to it)."""
    return [
        PodSetSize(naming.podset(s.role, s.owner), s.role, s.policy, s.max_replicas, s.pool)
        for s in role_slots(job)
    ]


def _template(
    job: RLJob, ref: JobRef, size: PodSetSize, settings: OperatorSettings, priority: Priority | None
) -> dict[str, Any]:
    pod = build_pod(job, ref, PodRequest(size.role, 0, size.policy, pool=size.pool), settings, priority)
    spec = dict(pod["spec"])
    spec.pop("hostname", None)  # per pod, not per podSet
    return {"metadata": {"labels": naming.labels(ref.name, size.role, size.owner)}, "spec": spec}


def build_workload(
    job: RLJob, ref: JobRef, settings: OperatorSettings, active: bool, priority: Priority | None = None
) -> Manifest:
    """The Workload; ``priority`` is the job's resolved ``scheduling.priorityClassName``."""
    assert job.spec.scheduling is not None and job.spec.scheduling.queue_name is not None
    podsets = [
        {"name": size.name, "count": size.count, "template": _template(job, ref, size, settings, priority)}
        for size in podset_sizes(job)
    ]
    manifest: Manifest = {
        "apiVersion": KUEUE_API_VERSION,
        "kind": "Workload",
        "metadata": metadata(ref, naming.workload(ref.name), naming.labels(ref.name)),
        "spec": {
            "queueName": job.spec.scheduling.queue_name,
            "podSets": podsets,
            **({"priorityClassRef": priority.workload_ref()} if priority else {}),
        },
    }
    # The hash covers what Kueue treats as immutable once quota is reserved (podSets, queue,
    # priorityClassRef); spec.active (suspend) is mutable and patched in place. The priority value
    # is left out: it is the class's value when the Workload is made, and a class whose value
    # changes later must not replace (and so requeue) a Workload that exists.
    stamp_hash(manifest)
    manifest["spec"]["active"] = active
    if priority is not None:
        manifest["spec"]["priority"] = priority.value
    return manifest


@dataclass(frozen=True)
class Admission:
    """What Kueue decided: per podSet, the admitted count and the flavors' node placement."""

    counts: dict[str, int]
    placement: dict[str, Placement]


def admitted_placement(workload: dict[str, Any], flavors: dict[str, dict[str, Any]]) -> Admission:
    """Counts and placement from ``status.admission``; ``flavors`` maps ResourceFlavor names to their
    ``spec`` (nodeLabels, tolerations), as fetched by the reconciler."""
    counts: dict[str, int] = {}
    placement: dict[str, Placement] = {}
    admission = (workload.get("status") or {}).get("admission") or {}
    for assignment in admission.get("podSetAssignments") or []:
        name = assignment.get("name", "main")
        if isinstance(assignment.get("count"), int):
            counts[name] = assignment["count"]
        selector: dict[str, str] = {}
        tolerations: list[dict[str, Any]] = []
        for flavor_name in sorted(set((assignment.get("flavors") or {}).values())):
            flavor = flavors.get(flavor_name) or {}
            selector.update(flavor.get("nodeLabels") or {})
            tolerations.extend(t for t in flavor.get("tolerations") or [] if t not in tolerations)
        if selector or tolerations:
            placement[name] = Placement(node_selector=selector, tolerations=tolerations)
    return Admission(counts, placement)


def admission_flavors(workload: dict[str, Any]) -> set[str]:
    """ResourceFlavor names an admission refers to (the reconciler fetches their specs)."""
    admission = (workload.get("status") or {}).get("admission") or {}
    return {
        str(name)
        for assignment in admission.get("podSetAssignments") or []
        for name in (assignment.get("flavors") or {}).values()
    }
