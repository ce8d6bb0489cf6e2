"""Where each role runs (``RLJobSpec.rollout_placement`` / ``trainer_placement``), table-driven: a
role of its own keeps its replicas and GPUs (defaults filled in), a pooled role takes its pool's."""

from __future__ import annotations

from typing import Any

import pytest

from polyrl_operator.api import Placement, RLJob
from polyrl_testenv.operator_fixtures import pooled_cpu_job, pooled_gpu_job, stored_job

# (case, job, policy index, role, spec changes to that role, expected placement)
PlacementCase = tuple[str, dict[str, Any], int, str, dict[str, Any], Placement]
CASES: list[PlacementCase] = [
    (
        "dedicated rollout: its own replicas and GPUs",
        stored_job(),
        0,
        "rollout",
        {},
        Placement(None, 0, None, 1, 2),
    ),
    (
        "dedicated rollout, nothing set: one pod of one GPU",
        stored_job(),
        0,
        "rollout",
        {"replicas": None, "gpus": None},
        Placement(None, 1, None, 1, 1),
    ),
    (
        "dedicated trainer on CPU: one rank per pod unless ranksPerPod says more",
        stored_job(),
        0,
        "trainer",
        {"ranksPerPod": 3, "replicas": 2},
        Placement(None, 0, None, 2, 2, ranks_per_pod=3),
    ),
    (
        "pooled rollout: one engine on each pod of the pool, the pool's GPUs",
        pooled_gpu_job(),
        0,
        "rollout",
        {},
        Placement("h100", 8, "h100", 2, 4),
    ),
    (
        "pooled trainer: the pool's first replicas.min pods, one rank per GPU",
        pooled_gpu_job(),
        0,
        "trainer",
        {},
        Placement("h100", 8, "h100", 2, 2, ranks_per_pod=8),
    ),
    (
        "pooled trainer on GPUs: ranksPerPod equal to the pool's gpus",
        pooled_gpu_job(),
        0,
        "trainer",
        {"ranksPerPod": 8},
        Placement("h100", 8, "h100", 2, 2, ranks_per_pod=8),
    ),
    (
        "pooled trainer on a CPU pool: one rank per pod by default",
        pooled_cpu_job(),
        0,
        "trainer",
        {},
        Placement("shared", 0, None, 1, 1, ranks_per_pod=1),
    ),
    (
        "pooled trainer on a CPU pool: ranksPerPod ranks per pod",
        pooled_cpu_job(),
        0,
        "trainer",
        {"ranksPerPod": 2},
        Placement("shared", 0, None, 1, 1, ranks_per_pod=2),
    ),
    (
        "a dedicated role beside pooled ones keeps its own pods",
        pooled_gpu_job(),
        1,
        "trainer",
        {},
        Placement(None, 4, "h100", 1, 1, ranks_per_pod=4),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_placement(case: PlacementCase) -> None:
    _, doc, policy, role, changes, expected = case
    settings = doc["spec"]["policies"][policy][role]
    for key, value in changes.items():
        if value is None:
            settings.pop(key, None)
        else:
            settings[key] = value
    spec = RLJob.model_validate(doc).spec
    p = spec.policies[policy]
    placement = spec.rollout_placement(p) if role == "rollout" else spec.trainer_placement(p)
    assert placement == expected


def test_trainer_world_is_ranks_on_the_pools_first_pods() -> None:
    spec = RLJob.model_validate(pooled_gpu_job()).spec
    assert spec.trainer_placement(spec.policies[0]).trainer_world == 2 * 8
    assert spec.pool("h100").replicas.max == 4
    with pytest.raises(KeyError, match="no pool 'a100'"):
        spec.pool("a100")


@pytest.mark.parametrize(
    ("max_replicas", "policy", "on_one_pod"),
    [
        (1, 0, True),  # rollout and trainer on one pool of one pod
        (3, 0, False),  # engines on the pool's other pods too
        (1, 1, False),  # the rollout pooled, the trainer on a pod of its own
    ],
)
def test_a_policy_is_on_one_pod_only_when_both_roles_share_a_one_pod_pool(
    max_replicas: int, policy: int, on_one_pod: bool
) -> None:
    doc = pooled_cpu_job()
    doc["spec"]["pools"][0]["replicas"] = {"min": 1, "max": max_replicas}
    spec = RLJob.model_validate(doc).spec
    assert spec.on_one_pod(spec.policies[policy]) is on_one_pod
    dedicated = RLJob.model_validate(stored_job()).spec
    assert not dedicated.on_one_pod(dedicated.policies[policy])


def test_cudaipc_is_valid_when_every_policy_is_colocated_on_a_gpu_pool_of_one_pod() -> None:
    doc = pooled_cpu_job()
    doc["spec"]["pools"][0]["gpus"] = 1
    doc["spec"]["pools"][0]["replicas"] = {"min": 1, "max": 1}
    listener = doc["spec"]["policies"][1]["trainer"]
    for key in ("replicas", "gpus", "resources"):
        listener.pop(key, None)
    listener["pool"] = "shared"
    doc["spec"]["weightSync"]["transport"] = "cudaipc"
    spec = RLJob.model_validate(doc).spec
    assert spec.weight_sync.transport == "cudaipc"
    assert all(spec.on_one_pod(p) and spec.trainer_placement(p).gpus == 1 for p in spec.policies)
    for policy in doc["spec"]["policies"]:  # vLLM engines read the trainer's memory as torch ones do
        policy["rollout"]["engine"] = "vllm"
    assert RLJob.model_validate(doc).spec.weight_sync.transport == "cudaipc"
