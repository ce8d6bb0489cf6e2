"""Child names (``polyrl_operator.naming``): every role's pods, Service, labels and podSet, from the
roles' traits (a policy's roles name their policy, a pool's pods their pool)."""

from __future__ import annotations

import pytest

from polyrl_operator import naming
from polyrl_operator.roles import Role

NAMES: list[tuple[Role, str | None, int, str, str]] = [
    ("coordinator", None, 0, "job-coordinator", "job-coordinator"),
    ("workflow", None, 3, "job-workflow-3", "job-workflow"),
    ("rollout", "alice", 1, "job-alice-rollout-1", "job-alice-rollout"),
    ("trainer", "bob", 0, "job-bob-trainer-0", "job-bob-trainer"),
    ("pool", "shared", 2, "job-pool-shared-2", "job-pool-shared"),
]


@pytest.mark.parametrize(("role", "owner", "index", "pod", "service"), NAMES, ids=[n[3] for n in NAMES])
def test_role_pod_and_service(role: Role, owner: str | None, index: int, pod: str, service: str) -> None:
    assert naming.role_pod("job", role, owner, index) == pod
    assert naming.role_service("job", role, owner) == service


OWNED: list[tuple[Role, str | None, dict[str, str], str]] = [
    ("workflow", None, {}, "workflow"),
    ("rollout", "alice", {naming.LABEL_POLICY: "alice"}, "alice-rollout"),
    # No policy's role is called "pool": a pool's podSet never meets a policy's.
    ("pool", "alice", {naming.LABEL_POOL: "alice"}, "alice-pool"),
]


@pytest.mark.parametrize(("role", "owner", "owner_label", "podset"), OWNED, ids=[o[3] for o in OWNED])
def test_labels_selector_and_podset(
    role: Role, owner: str | None, owner_label: dict[str, str], podset: str
) -> None:
    selector = {naming.LABEL_JOB: "job", naming.LABEL_ROLE: role, **owner_label}
    assert naming.selector("job", role, owner) == selector
    assert naming.labels("job", role, owner) == {**selector, naming.LABEL_MANAGED_BY: naming.MANAGER}
    assert naming.podset(role, owner) == podset


def test_the_named_helpers_agree() -> None:
    assert naming.role_pod("job", "coordinator", None, 0) == naming.coordinator_pod("job")
    assert naming.role_service("job", "coordinator", None) == naming.coordinator_service("job")
    assert naming.role_pod("job", "workflow", None, 2) == naming.workflow_pod("job", 2)
    assert naming.role_service("job", "workflow", None) == naming.workflow_service("job")
    assert naming.role_pod("job", "pool", "gpu", 0) == naming.pool_pod("job", "gpu", 0)
    assert naming.role_service("job", "pool", "gpu") == naming.pool_service("job", "gpu")


def test_the_longest_child_name_counts_the_pools_services() -> None:
    assert naming.longest_child_name("job", ["a"], 1, ["a-very-long-pool-name"]) == (
        "job-pool-a-very-long-pool-name",
        30,
    )
