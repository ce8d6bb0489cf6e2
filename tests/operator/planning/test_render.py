"""``polyrl render`` (``polyrl_operator.planning.render``): prints what the operator creates, and
rejects what it would reject."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator.cli import main
from polyrl_operator.planning import render
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv.bad_rljobs import EXAMPLES
from polyrl_testenv.operator_fixtures import stored_job


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_render_prints_what_the_operator_creates(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(path), "-n", "demo"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    kinds = [d["kind"] for d in docs]
    assert kinds.index("ConfigMap") < kinds.index("Pod")
    assert all(d["metadata"]["namespace"] in ("demo", "team-a") for d in docs)
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert secret["stringData"]["ray-token"].startswith("<")
    body = yaml.safe_load(path.read_text())
    assert render(body, OperatorSettings()) == render(body, OperatorSettings())  # deterministic


def test_render_rejects_what_the_operator_would_reject(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = stored_job()
    body["spec"]["workflow"]["podTemplate"] = {"spec": {"restartPolicy": "OnFailure"}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(body))
    assert main(["render", str(path)]) == 1
    assert "spec.workflow.podTemplate.spec.restartPolicy" in capsys.readouterr().err


def _ports(manifest: dict[str, Any]) -> dict[str, int]:
    if manifest["kind"] == "Service":
        return {p["name"]: p["port"] for p in manifest["spec"]["ports"]}
    [container] = manifest["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in container["ports"]}


HEAD_PORTS = {"http": 8000, "gcs": 6379, "client": 10001}


@pytest.mark.parametrize(
    ("dashboard", "expected"),
    [
        (None, HEAD_PORTS),  # the default: off
        (False, HEAD_PORTS),
        (True, {**HEAD_PORTS, "dashboard": 8265}),
    ],
)
def test_the_rendered_coordinator_exposes_the_dashboard_only_when_the_head_serves_it(
    dashboard: bool | None, expected: dict[str, int]
) -> None:
    body = stored_job()
    body["metadata"] = {"name": "signal-game", "namespace": "ns"}
    if dashboard is not None:
        body["spec"]["coordinator"] = {"dashboard": dashboard}
    rendered = {(m["kind"], m["metadata"]["name"]): m for m in render(body, OperatorSettings())}
    assert _ports(rendered["Service", "signal-game-coordinator"]) == expected
    assert _ports(rendered["Pod", "signal-game-coordinator"]) == expected
