"""The roles (``polyrl_operator.roles``): the traits table covers every role, and a job's role slots
say where each role's settings sit and how many pods it may have."""

from __future__ import annotations

from typing import get_args

import pytest

from polyrl_operator.api import RLJob
from polyrl_operator.roles import ROLE_TRAITS, ROLES, Role, restarts_job, role_slot, role_slots, traits_of
from polyrl_testenv.operator_fixtures import gpu_job

JOB = RLJob.model_validate({**gpu_job(), "metadata": {"name": "debate", "namespace": "team-a"}})


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


@pytest.mark.parametrize(
    ("label", "restarts"),
    [
        ("coordinator", True),
        ("trainer", True),
        ("rollout", False),
        ("workflow", False),
        ("other", False),
        (None, False),
    ],
)
def test_which_pod_labels_restart_the_job(label: str | None, restarts: bool) -> None:
    assert restarts_job(label) is restarts
    assert (traits_of(label) is None) is (label not in ROLES)
