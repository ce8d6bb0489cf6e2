"""The Kueue Workload (``polyrl_operator.builders.workload``), table-driven: one podSet per role
slot (a pool's included) at its maximum count, the job's priority on it, and what its hash covers."""

from __future__ import annotations

from typing import Any

import pytest

from polyrl_operator.api import RLJob
from polyrl_operator.builders.common import JobRef
from polyrl_operator.builders.priority import Priority
from polyrl_operator.builders.workload import build_workload
from polyrl_operator.roles import Role
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv.operator_fixtures import gpu_job, pooled_gpu_job

REF = JobRef("debate", "team-a", "uid-1")


def debate() -> RLJob:
    """manifests/examples/debate-gpu.yaml: three policies, a queue."""
    return RLJob.model_validate({**gpu_job(), "metadata": {"name": "debate", "namespace": "team-a"}})


# (podSet, count, role, policy): elastic roles at their maximum, so an admitted job can scale out.
PODSETS: list[tuple[str, int, Role, str | None]] = [
    ("coordinator", 1, "coordinator", None),
    ("workflow", 8, "workflow", None),
    ("proposer-rollout", 8, "rollout", "proposer"),
    ("proposer-trainer", 2, "trainer", "proposer"),
    ("critic-rollout", 4, "rollout", "critic"),
    ("critic-trainer", 1, "trainer", "critic"),
    ("judge-rollout", 2, "rollout", "judge"),
    ("judge-trainer", 1, "trainer", "judge"),
]


# The same job with pool h100 (2 to 4 pods of 8 GPUs) hosting the proposer's rollout and trainer and
# the critic's rollout: one podSet for the pool, at its maximum, and none for the roles placed on it.
POOLED_PODSETS: list[tuple[str, int, Role, str | None, int]] = [
    ("coordinator", 1, "coordinator", None, 0),
    ("workflow", 8, "workflow", None, 0),
    ("critic-trainer", 1, "trainer", "critic", 4),
    ("judge-rollout", 2, "rollout", "judge", 2),
    ("judge-trainer", 1, "trainer", "judge", 8),
    ("h100-pool", 4, "pool", "h100", 8),
]


def test_one_podset_per_pool() -> None:
    job = RLJob.model_validate({**pooled_gpu_job(), "metadata": {"name": "debate", "namespace": "team-a"}})
    podsets = build_workload(job, REF, OperatorSettings(), active=True)["spec"]["podSets"]
    seen = []
    for podset in podsets:
        labels = podset["template"]["metadata"]["labels"]
        owner = labels.get("polyrl.dev/policy", labels.get("polyrl.dev/pool"))
        [container] = podset["template"]["spec"]["containers"]
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)
        seen.append((podset["name"], podset["count"], labels["polyrl.dev/role"], owner, gpus))
    assert seen == POOLED_PODSETS
    pool = podsets[-1]["template"]
    assert pool["spec"]["nodeSelector"] == {"polyrl.dev/gpu-type": "h100"}
    assert "polyrl.dev/policy" not in pool["metadata"]["labels"]


def test_one_podset_per_role_slot_in_order() -> None:
    workload = build_workload(debate(), REF, OperatorSettings(), active=True)
    assert workload["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    assert [p["name"] for p in workload["spec"]["podSets"]] == [p[0] for p in PODSETS]


@pytest.mark.parametrize(("name", "count", "role", "policy"), PODSETS, ids=[p[0] for p in PODSETS])
def test_podset(name: str, count: int, role: Role, policy: str | None) -> None:
    workload = build_workload(debate(), REF, OperatorSettings(), active=True)
    [podset] = [p for p in workload["spec"]["podSets"] if p["name"] == name]
    assert podset["count"] == count
    labels = podset["template"]["metadata"]["labels"]
    assert (labels["polyrl.dev/role"], labels.get("polyrl.dev/policy")) == (role, policy)
    assert "hostname" not in podset["template"]["spec"]  # per pod, not per podSet


WORKLOAD_CASES: list[tuple[str, Priority | None, dict[str, Any], str | None]] = [
    ("no priority", None, {}, None),
    (
        "WorkloadPriorityClass: Workload only, pods name no class",
        Priority("rl-batch", "WorkloadPriorityClass", 1000),
        {"priorityClassRef": {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "rl-batch"},
         "priority": 1000},
        None,
    ),
    (
        "PriorityClass: the Workload and the pods",
        Priority("high", "PriorityClass", 100),
        {"priorityClassRef": {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "high"}, "priority": 100},
        "high",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "priority", "fields", "pod_class"), WORKLOAD_CASES, ids=[c[0] for c in WORKLOAD_CASES]
)
def test_workload_carries_the_priority(
    case: str, priority: Priority | None, fields: dict[str, Any], pod_class: str | None
) -> None:
    job = debate()
    workload = build_workload(job, REF, OperatorSettings(), active=True, priority=priority)
    plain = build_workload(job, REF, OperatorSettings(), active=True)
    assert {k: v for k, v in workload["spec"].items() if k.startswith("priority")} == fields
    # Kueue refuses a priorityClassRef change once quota is reserved: it is part of the hash.
    assert (workload["metadata"]["annotations"] == plain["metadata"]["annotations"]) == (priority is None)
    assert (priority.pod_priority_class_name if priority else None) == pod_class


# What the hash covers is what Kueue treats as immutable once quota is reserved: a different hash
# replaces (and so requeues) the Workload.
HASH_CASES: list[tuple[str, dict[str, Any], dict[str, Any], bool]] = [
    ("the priority value: not hashed", {"priority": Priority("p", "PriorityClass", 1)}, {"priority": Priority("p", "PriorityClass", 2)}, True),
    ("the priority class: hashed", {"priority": Priority("a", "PriorityClass", 1)}, {"priority": Priority("b", "PriorityClass", 1)}, False),
    ("spec.active (suspend): not hashed, patched in place", {"active": True}, {"active": False}, True),
]  # fmt: skip


@pytest.mark.parametrize(("case", "left", "right", "same"), HASH_CASES, ids=[c[0] for c in HASH_CASES])
def test_workload_hash(case: str, left: dict[str, Any], right: dict[str, Any], same: bool) -> None:
    job = debate()
    a, b = (
        build_workload(job, REF, OperatorSettings(), **{"active": True, **kwargs}) for kwargs in (left, right)
    )
    assert (a["metadata"]["annotations"] == b["metadata"]["annotations"]) is same
    for built, kwargs in ((a, left), (b, right)):
        if "priority" in kwargs:
            assert built["spec"]["priority"] == kwargs["priority"].value
        assert built["spec"]["active"] is kwargs.get("active", True)
