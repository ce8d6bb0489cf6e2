"""Services (``polyrl_operator.builders.services``), table-driven: the coordinator's ClusterIP
Service (the Ray dashboard's port only when the head serves it) and a headless Service per role
(per policy for a policy's roles, per pool for a pool's pods)."""

from __future__ import annotations

from typing import Any

import pytest

from polyrl_operator.builders import JobRef, build_coordinator_service, build_headless_service
from polyrl_operator.roles import Role

REF = JobRef("signal-game", "ns", "uid-1")
HEAD = {"http": 8000, "gcs": 6379, "client": 10001}


def _ports(service: dict[str, Any]) -> dict[str, int]:
    assert all(p["port"] == p["targetPort"] for p in service["spec"]["ports"])
    return {p["name"]: p["port"] for p in service["spec"]["ports"]}


COORDINATOR: list[tuple[str, bool, dict[str, int]]] = [
    ("dashboard off", False, HEAD),
    ("dashboard on", True, {**HEAD, "dashboard": 8265}),
]


@pytest.mark.parametrize(("case", "dashboard", "ports"), COORDINATOR, ids=[c[0] for c in COORDINATOR])
def test_coordinator_service(case: str, dashboard: bool, ports: dict[str, int]) -> None:
    service = build_coordinator_service(REF, dashboard=dashboard)
    assert service["metadata"]["name"] == "signal-game-coordinator"
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"] == {"polyrl.dev/job": "signal-game", "polyrl.dev/role": "coordinator"}
    assert _ports(service) == ports


HEADLESS: list[tuple[Role, str | None, str, dict[str, str]]] = [
    ("workflow", None, "signal-game-workflow", {}),
    ("rollout", "speaker", "signal-game-speaker-rollout", {"polyrl.dev/policy": "speaker"}),
    ("trainer", "listener", "signal-game-listener-trainer", {"polyrl.dev/policy": "listener"}),
    ("pool", "shared", "signal-game-pool-shared", {"polyrl.dev/pool": "shared"}),
]


@pytest.mark.parametrize(("role", "owner", "name", "owner_selector"), HEADLESS, ids=[h[2] for h in HEADLESS])
def test_headless_service(role: Role, owner: str | None, name: str, owner_selector: dict[str, str]) -> None:
    service = build_headless_service(REF, role, owner)
    assert service["metadata"]["name"] == name
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {
        "polyrl.dev/job": "signal-game",
        "polyrl.dev/role": role,
        **owner_selector,
    }
    assert _ports(service) == {"http": 8000, "rendezvous": 29500}
