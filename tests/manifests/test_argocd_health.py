"""The Argo CD health check for RLJob, run in a real Lua 5.1 interpreter (Argo CD's gopher-lua is 5.1)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from lupa import lua51

from polyrl_testenv.bad_rljobs import REPO

ARGOCD = REPO / "manifests" / "argocd"
SCRIPT = (ARGOCD / "health-rljob.lua").read_text()


def health(obj: dict[str, Any]) -> tuple[str, str]:
    """Run the script the way Argo CD does: a chunk with a global ``obj`` that returns a table."""
    runtime = lua51.LuaRuntime(unpack_returned_tuples=True)
    runtime.globals().obj = runtime.table_from(obj, recursive=True)
    result = runtime.execute(SCRIPT)
    return str(result["status"]), str(result["message"])


def _cond(ctype: str, status: str, message: str = "", reason: str = "Test") -> dict[str, Any]:
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2026-11-22T00:00:00Z",
    }


def _job(generation: int = 1, **status: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "polyrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "j", "namespace": "ns", "generation": generation},
        "spec": {},
    }
    if status:
        obj["status"] = {"observedGeneration": generation, **status}
    return obj


CASES = [
    ("no-status", _job(), "Progressing"),
    ("pending", _job(phase="Pending", conditions=[_cond("Ready", "False", "creating pods")]), "Progressing"),
    ("admitted", _job(phase="Admitted", conditions=[_cond("Admitted", "True")]), "Progressing"),
    (
        "running-not-ready",
        _job(phase="Running", conditions=[_cond("Ready", "False", "2/3 pods")]),
        "Progressing",
    ),
    (
        "running-ready",
        _job(phase="Running", conditions=[_cond("Ready", "True", "all pods ready")]),
        "Healthy",
    ),
    ("succeeded", _job(phase="Succeeded", conditions=[_cond("Succeeded", "True", "done")]), "Healthy"),
    ("suspended", _job(phase="Suspended", conditions=[_cond("Suspended", "True", "by spec")]), "Suspended"),
    ("failed", _job(phase="Failed", conditions=[_cond("Failed", "True", "restarts exhausted")]), "Degraded"),
    (
        "quota",
        _job(phase="Pending", conditions=[_cond("QuotaExceeded", "True", "exceeded quota: gpu")]),
        "Degraded",
    ),
    (
        "stale-generation",
        {**_job(phase="Running", conditions=[_cond("Ready", "True")]), "metadata": {"generation": 2}},
        "Progressing",
    ),
]


@pytest.mark.parametrize(("obj", "expected"), [(o, e) for _, o, e in CASES], ids=[c[0] for c in CASES])
def test_health_of_each_lifecycle_state(obj: dict[str, Any], expected: str) -> None:
    status, message = health(copy.deepcopy(obj))
    assert status == expected
    assert message


def test_failed_message_is_the_reason() -> None:
    _, message = health(
        _job(phase="Failed", conditions=[_cond("Failed", "True", "coordinator crashed 4 times")])
    )
    assert message == "coordinator crashed 4 times"


def test_argocd_cm_patch_embeds_the_script_verbatim() -> None:
    patch = yaml.safe_load((ARGOCD / "argocd-cm-patch.yaml").read_text())
    assert patch["data"]["resource.customizations.health.polyrl.dev_RLJob"] == SCRIPT
