"""The roles (``polyrl_operator.roles``): the traits table covers every role, and a job's role slots
say where each role's settings sit and how many pods it may have; a pool's slot lists the roles
placed on it, and each of its pods has the traits of the roles it hosts."""

from __future__ import annotations

from typing import get_args

import pytest

from polyrl_operator.api import RLJob
from polyrl_operator.roles import (
    ROLE_TRAITS,
    ROLES,
    PlacedRole,
    Role,
    pod_traits,
    role_slot,
    role_slots,
    traits_of,
)
from polyrl_testenv.operator_fixtures import gpu_job, pooled_cpu_job, pooled_gpu_job

JOB = RLJob.model_validate({**gpu_job(), "metadata": {"name": "debate", "namespace": "team-a"}})
POOLED = RLJob.model_validate(pooled_gpu_job())


def test_every_role_has_its_traits() -> None:
    assert ROLES == get_args(Role) == tuple(ROLE_TRAITS)


# (role, policy) -> (spec path, min, max, GPUs, GPU type) of manifests/examples/debate-gpu.yaml, in order.
SLOTS: list[tuple[Role, str | None, tuple[str, int, int, int, str | None]]] = [
    ("coordinator", None, ("spec.coordinator", 1, 1, 0, None)),
    ("workflow", None, ("spec.workflow", 2, 8, 0, None)),
    ("rollout", "proposer", ("spec.policies[0].rollout", 2, 8, 1, "l40s")),
    ("trainer", "proposer", ("spec.policies[0].trainer", 2, 2, 8, "h100")),
    ("rollout", "critic", ("spec.policies[1].rollout", 1, 4, 1, "l40s")),
    ("trainer", "critic", ("spec.policies[1].trainer", 1, 1, 4, "h100")),
    ("rollout", "judge", ("spec.policies[2].rollout", 1, 2, 2, "a100-80gb")),
    ("trainer", "judge", ("spec.policies[2].trainer", 1, 1, 8, "h100")),
]


def test_role_slots_in_order() -> None:
    assert [(s.role, s.policy) for s in role_slots(JOB)] == [(r, p) for r, p, _ in SLOTS]


@pytest.mark.parametrize(("role", "policy", "expected"), SLOTS, ids=[s[2][0] for s in SLOTS])
def test_role_slot(role: Role, policy: str | None, expected: tuple[str, int, int, int, str | None]) -> None:
    slot = role_slot(JOB, role, policy)
    assert (slot.path, slot.min_replicas, slot.max_replicas, slot.gpus, slot.gpu_type) == expected
    assert slot.traits.elastic or slot.min_replicas == slot.max_replicas  # only elastic roles have a range
    assert slot.traits.gpus or slot.gpus == 0


def test_a_policy_the_job_lacks_is_named() -> None:
    with pytest.raises(KeyError, match="no policy 'nobody' in job debate"):
        role_slot(JOB, "rollout", "nobody")


# (role label, owner, index, in a restart attempt, replaced alone when it fails)
@pytest.mark.parametrize(
    ("label", "owner", "index", "restarts", "alone"),
    [
        ("coordinator", None, 0, True, False),
        # A trainer's own pod: in the attempt, but its failure restarts that trainer alone.
        ("trainer", "judge", 0, True, True),
        ("rollout", "judge", 0, False, False),
        ("workflow", None, 1, False, False),
        # Pool h100 hosts the proposer's trainer on its first replicas.min (2) pods only; their
        # failure restarts the job.
        ("pool", "h100", 0, True, False),
        ("pool", "h100", 1, True, False),
        ("pool", "h100", 2, False, False),
        ("pool", "gone", 0, False, False),
        ("other", None, 0, False, False),
        (None, None, 0, False, False),
    ],
)
def test_which_pods_restart_the_job(
    label: str | None, owner: str | None, index: int, restarts: bool, alone: bool
) -> None:
    traits = pod_traits(POOLED, label, owner, index)
    assert (traits is not None and traits.restarts_job) is restarts
    assert (traits is not None and traits.replaced_alone_on_failure) is alone
    assert (traits_of(label) is None) is (label not in ROLES)


# The GPU example with pool h100 (2 to 4 pods of 8 GPUs) hosting the proposer's rollout and trainer
# and the critic's rollout: those roles lose their slots, the pool's comes last.
POOLED_SLOTS: list[tuple[Role, str | None, tuple[str, int, int, int, str | None]]] = [
    ("coordinator", None, ("spec.coordinator", 1, 1, 0, None)),
    ("workflow", None, ("spec.workflow", 2, 8, 0, None)),
    ("trainer", "critic", ("spec.policies[1].trainer", 1, 1, 4, "h100")),
    ("rollout", "judge", ("spec.policies[2].rollout", 1, 2, 2, "a100-80gb")),
    ("trainer", "judge", ("spec.policies[2].trainer", 1, 1, 8, "h100")),
    ("pool", "h100", ("spec.pools[0]", 2, 4, 8, "h100")),
]


def test_pooled_roles_have_no_slot_of_their_own() -> None:
    slots = role_slots(POOLED)
    assert [
        (s.role, s.owner, (s.path, s.min_replicas, s.max_replicas, s.gpus, s.gpu_type)) for s in slots
    ] == (POOLED_SLOTS)
    pool = slots[-1]
    assert (pool.pool, pool.policy) == ("h100", None)
    assert [str(r) for r in pool.placed] == ["proposer/rollout", "proposer/trainer", "critic/rollout"]
    with pytest.raises(KeyError, match="the rollout of policy 'proposer' in job debate runs on a pool"):
        role_slot(POOLED, "rollout", "proposer")
    with pytest.raises(KeyError, match="no pool 'h200' in job debate"):
        role_slot(POOLED, "pool", "h200")


ALL_THREE = ["proposer/rollout", "proposer/trainer", "critic/rollout"]
ENGINES = ["proposer/rollout", "critic/rollout"]


# (pod index, the roles it hosts, (restarts the job, rendezvous port, checkpoint claim, model mount))
@pytest.mark.parametrize(
    ("index", "hosted", "traits"),
    [
        (0, ALL_THREE, (True, True, True, "read-write")),
        (1, ALL_THREE, (True, True, True, "read-write")),
        # Past replicas.min: rollout engines only, like a rollout pod.
        (2, ENGINES, (False, False, False, "read-only")),
        (3, ENGINES, (False, False, False, "read-only")),
    ],
)
def test_a_pool_pod_has_the_traits_of_what_it_hosts(
    index: int, hosted: list[str], traits: tuple[bool, bool, bool, str]
) -> None:
    slot = role_slot(POOLED, "pool", "h100")
    got = slot.traits_at(index)
    assert [str(r) for r in slot.hosted(index)] == hosted
    assert (got.restarts_job, got.rendezvous, got.mounts_checkpoint, got.model_mount) == traits
    # What does not depend on what a pod hosts stays the pool's own.
    own = ROLE_TRAITS["pool"]
    assert (got.elastic, got.per_pool, got.entry_point, got.gpus) == (True, True, "worker", True)
    assert (own.restarts_job, own.model_mount) == (False, "none")
    assert not got.metrics_sinks and not got.mounts_data and not got.ray_head


def test_a_pool_without_rollouts_stays_at_its_minimum() -> None:
    """Only rollout engines run past replicas.min: a pool hosting trainers alone never scales out."""
    doc = pooled_cpu_job()
    doc["spec"]["policies"][0]["rollout"] = {"engine": "torch", "gpus": 0}
    doc["spec"]["policies"][1]["rollout"] = {"engine": "torch", "gpus": 0}
    slot = role_slot(RLJob.model_validate(doc), "pool", "shared")
    assert (slot.min_replicas, slot.max_replicas, slot.placed) == (1, 1, (PlacedRole("speaker", "trainer"),))


def test_every_pool_slot_has_the_traits_of_its_role() -> None:
    assert all(s.traits is ROLE_TRAITS[s.role] for s in role_slots(POOLED))
    assert [s.traits_at(0) == s.traits for s in role_slots(POOLED)] == [True] * 5 + [False]
