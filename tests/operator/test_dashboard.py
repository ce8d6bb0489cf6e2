"""`spec.coordinator.dashboard`: the coordinator pod and Service expose the Ray dashboard's port only
when the head serves it; off by default."""

from __future__ import annotations

from typing import Any

import pytest

from polyrl_operator import naming
from polyrl_operator.api import RLJob
from polyrl_operator.builders import JobRef, PodRequest, build_coordinator_service, build_pod
from polyrl_operator.planning.render import render
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv.operator_fixtures import stored_job

REF = JobRef("signal-game", "ns", "uid-1")


def _body(dashboard: bool | None) -> dict[str, Any]:
    body = stored_job()
    body["metadata"] = {"name": "signal-game", "namespace": "ns"}
    if dashboard is not None:
        body["spec"]["coordinator"] = {"dashboard": dashboard}
    return body


def _ports(manifest: dict[str, Any]) -> dict[str, int]:
    if manifest["kind"] == "Service":
        return {p["name"]: p["port"] for p in manifest["spec"]["ports"]}
    [container] = manifest["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in container["ports"]}


@pytest.mark.parametrize(
    ("dashboard", "expected"),
    [
        (None, {"http": 8000, "gcs": 6379, "client": 10001}),  # the default: off
        (False, {"http": 8000, "gcs": 6379, "client": 10001}),
        (True, {"http": 8000, "gcs": 6379, "client": 10001, "dashboard": naming.PORT_RAY_DASHBOARD}),
    ],
)
def test_the_dashboard_port_is_exposed_only_when_the_head_serves_it(
    dashboard: bool | None, expected: dict[str, int]
) -> None:
    job = RLJob.model_validate(_body(dashboard))
    assert job.spec.coordinator.dashboard is bool(dashboard)
    pod = build_pod(job, REF, PodRequest("coordinator"), OperatorSettings())
    service = build_coordinator_service(REF, dashboard=job.spec.coordinator.dashboard)
    assert _ports(pod) == expected
    assert _ports(service) == expected
    # the operator's full plan (what `polyrl render` prints) agrees with the builders
    rendered = {(m["kind"], m["metadata"]["name"]): m for m in render(_body(dashboard), OperatorSettings())}
    assert _ports(rendered["Service", "signal-game-coordinator"]) == expected
    assert _ports(rendered["Pod", "signal-game-coordinator"]) == expected


def test_worker_pods_never_expose_the_dashboard() -> None:
    job = RLJob.model_validate(_body(True))
    for req in (
        PodRequest("workflow"),
        PodRequest("rollout", 0, "speaker"),
        PodRequest("trainer", 0, "speaker"),
    ):
        assert "dashboard" not in _ports(build_pod(job, REF, req, OperatorSettings())), req


def test_the_dashboard_field_is_a_boolean() -> None:
    body = _body(None)
    body["spec"]["coordinator"] = {"dashboard": "sometimes"}
    with pytest.raises(ValueError, match=r"coordinator\.dashboard"):
        RLJob.model_validate(body)
