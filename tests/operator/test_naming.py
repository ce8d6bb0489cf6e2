"""Child names (``polyrl_operator.naming``): every role's pods and Service, from the roles' traits."""

from __future__ import annotations

import pytest

from polyrl_operator import naming
from polyrl_operator.roles import Role

NAMES: list[tuple[Role, str | None, int, str, str]] = [
    ("coordinator", None, 0, "job-coordinator", "job-coordinator"),
    ("workflow", None, 3, "job-workflow-3", "job-workflow"),
    ("rollout", "alice", 1, "job-alice-rollout-1", "job-alice-rollout"),
    ("trainer", "bob", 0, "job-bob-trainer-0", "job-bob-trainer"),
]


@pytest.mark.parametrize(("role", "policy", "index", "pod", "service"), NAMES, ids=[n[3] for n in NAMES])
def test_role_pod_and_service(role: Role, policy: str | None, index: int, pod: str, service: str) -> None:
    assert naming.role_pod("job", role, policy, index) == pod
    assert naming.role_service("job", role, policy) == service


def test_the_named_helpers_agree() -> None:
    assert naming.role_pod("job", "coordinator", None, 0) == naming.coordinator_pod("job")
    assert naming.role_service("job", "coordinator", None) == naming.coordinator_service("job")
    assert naming.role_pod("job", "workflow", None, 2) == naming.workflow_pod("job", 2)
    assert naming.role_service("job", "workflow", None) == naming.workflow_service("job")
