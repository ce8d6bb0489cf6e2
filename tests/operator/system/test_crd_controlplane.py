"""The generated CRD on the Kubernetes CRD server (etcd + apiextensions-apiserver + shim): installs,
serves defaults, printer columns and status, and rejects every bad input that `polyrl validate`
rejects, naming the same field."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator.api import RLJob
from polyrl_operator.validation import validate_file
from polyrl_testenv.bad_rljobs import BAD_CASES, EXAMPLES, REPO, BadCase, base_job, frozen_on_a_shared_base

pytestmark = pytest.mark.controlplane

CRD_FILE = REPO / "crds" / "polyrl.dev_rljobs.yaml"


def _apply(cp: Any, doc: dict[str, Any], namespace: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return cp.kubectl("apply", "-n", namespace, "-f", "-", *extra, input=yaml.safe_dump(doc))


@pytest.fixture(scope="module")
def crd(controlplane: Any) -> Any:
    result = controlplane.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    assert result.returncode == 0, result.stderr
    waited = controlplane.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/rljobs.polyrl.dev"
    )
    assert waited.returncode == 0, waited.stderr
    return controlplane


def test_crd_is_established_with_names(crd: Any) -> None:
    got = json.loads(crd.kubectl("get", "crd", "rljobs.polyrl.dev", "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in got["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    assert got["status"]["acceptedNames"]["shortNames"] == ["rlj"]
    resources = crd.kubectl("api-resources", "--api-group=polyrl.dev", "-o", "wide").stdout
    assert "rljobs" in resources and "rlj" in resources and "RLJob" in resources


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_applies(crd: Any, namespace: str, path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        doc["metadata"]["namespace"] = namespace
        result = _apply(crd, doc, namespace)
        assert result.returncode == 0, result.stderr
        assert "created" in result.stdout


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.id)
def test_bad_input_is_rejected_by_server_and_validate(
    crd: Any, namespace: str, case: BadCase, tmp_path: Path
) -> None:
    doc = case.document()  # each test has its own namespace, so names never collide
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))

    local = validate_file(path)
    assert case.field in [p.path for p in local.problems]

    result = crd.kubectl("apply", "-n", namespace, "-f", str(path))
    if not case.server_rejects:
        return
    assert result.returncode != 0, f"server accepted {case.id}: {result.stdout}"
    for needle in case.server_mentions:
        assert needle in result.stderr, f"{case.id}: {needle!r} not in server error:\n{result.stderr}"
    # Nothing was stored.
    name = doc["metadata"]["name"]
    got = crd.kubectl("get", "rljob", name, "-n", namespace, "--ignore-not-found", "-o", "name")
    assert got.stdout.strip() == ""


def test_unknown_field_rejected_even_client_side_apply(crd: Any, namespace: str) -> None:
    doc = base_job("typo")
    doc["spec"]["weightSync"]["bucketMb"] = 64
    result = _apply(crd, doc, namespace, "--validate=strict")
    assert result.returncode != 0
    assert "bucketMb" in result.stderr


def test_defaults_come_back_and_match_the_models(crd: Any, namespace: str) -> None:
    minimal = {
        "apiVersion": "polyrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "minimal", "namespace": namespace},
        "spec": {
            "training": {"totalSteps": 5},
            "workflow": {"entrypoint": "pkg.mod:Game"},
            "policies": [{"name": "solo", "model": {"uri": "builtin://tiny"}}],
        },
    }
    assert _apply(crd, minimal, namespace).returncode == 0
    stored = json.loads(crd.kubectl("get", "rljob", "minimal", "-n", namespace, "-o", "json").stdout)
    spec = stored["spec"]
    assert spec["mode"] == "async"
    assert spec["weightSync"] == {
        "transport": "auto",
        "bucketMB": 256,
        "deltas": 0,
        "fullEvery": 8,
        "inflight": "keep",
    }
    assert spec["training"]["episodesPerStep"] == 64
    policy = spec["policies"][0]
    assert policy["algorithm"]["name"] == "grpo" and policy["algorithm"]["groupSize"] == 8
    # Unset replicas and gpus stay unset (a role placed on a pool must leave them so); the operator
    # resolves a dedicated role's defaults (RLJobSpec.rollout_placement / trainer_placement).
    assert "replicas" not in policy["rollout"] and "gpus" not in policy["trainer"]
    assert policy["trainer"]["zeroStage"] == 2
    # The server's defaults are exactly the models' defaults.
    model_view = RLJob.model_validate(minimal).to_k8s()["spec"]
    assert spec == model_view


def test_a_frozen_policy_round_trips_and_every_policy_frozen_is_refused(crd: Any, namespace: str) -> None:
    doc = yaml.safe_load((EXAMPLES / "signal-game-frozen-listener-cpu.yaml").read_text())
    doc["metadata"] = {"name": "frozen", "namespace": namespace}
    assert _apply(crd, doc, namespace).returncode == 0
    stored = json.loads(crd.kubectl("get", "rljob", "frozen", "-n", namespace, "-o", "json").stdout)
    # The server fills in the trainer's defaults; they read back as a frozen policy's (no trainer).
    assert RLJob.model_validate(stored).spec.policies[1].frozen
    doc["metadata"]["name"] = "all-frozen"
    doc["spec"]["policies"][0] = {**doc["spec"]["policies"][1], "name": "speaker"}
    result = _apply(crd, doc, namespace)
    assert result.returncode != 0 and "at least one policy must be trained" in result.stderr


def test_a_frozen_policy_on_a_lora_policys_base_is_accepted(crd: Any, namespace: str, tmp_path: Path) -> None:
    """The shared-base rules (one engine, one trustRemoteCode, adapter transports) hold a frozen member
    to its group's settings and accept it when they agree, as `polyrl validate` does."""
    doc = frozen_on_a_shared_base(base_job("frozen-on-a-base"))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert validate_file(path).problems == []
    result = _apply(crd, doc, namespace)
    assert result.returncode == 0, result.stderr


def test_printer_columns(crd: Any, namespace: str) -> None:
    doc = base_job("columns")
    assert _apply(crd, doc, namespace).returncode == 0
    status = {
        "status": {
            "phase": "Running",
            "step": 4,
            "policySummary": "speaker:v5 listener:v4",
            "startTime": "2026-01-01T12:00:00Z",
            "pools": [{"name": "shared", "desired": 2, "ready": 1, "roles": ["speaker/rollout"]}],
            "poolSummary": "shared:1/2",
            "ratingSummary": "speaker:1147",
        }
    }
    patched = crd.kubectl(
        "patch",
        "rljob",
        "columns",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )
    assert patched.returncode == 0, patched.stderr
    table = crd.kubectl("get", "rljobs", "-n", namespace, "columns").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "POLICIES", "STEP", "AGE"]
    assert table[1].split()[:5] == ["columns", "Running", "speaker:v5", "listener:v4", "4"]
    short = crd.kubectl("get", "rlj", "-n", namespace, "columns", "-o", "wide").stdout.splitlines()
    assert short[0].split() == [
        "NAME",
        "PHASE",
        "POLICIES",
        "STEP",
        "TOTAL",
        "MODE",
        "RESTARTS",
        "POOLS",
        "RATINGS",
        "STARTED",
        "COMPLETED",
        "AGE",
    ]
    assert "shared:1/2" in short[1].split() and "speaker:1147" in short[1].split()
    for category in ("polyrl", "all"):
        listed = crd.kubectl("get", category, "-n", namespace)
        assert listed.returncode == 0, listed.stderr
        names = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
        assert names & {"columns", "rljob.polyrl.dev/columns"}, (category, listed.stdout)


def test_status_subresource_is_separate_from_spec(crd: Any, namespace: str) -> None:
    doc = base_job("status")
    assert _apply(crd, doc, namespace).returncode == 0
    before = json.loads(crd.kubectl("get", "rljob", "status", "-n", namespace, "-o", "json").stdout)
    status = {"status": {"phase": "Running", "step": 3, "restarts": 0, "observedGeneration": 1}}
    patched = crd.kubectl(
        "patch",
        "rljob",
        "status",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )
    assert patched.returncode == 0, patched.stderr
    table = crd.kubectl("get", "rljob", "status", "-n", namespace).stdout
    assert "Running" in table
    after = json.loads(crd.kubectl("get", "rljob", "status", "-n", namespace, "-o", "json").stdout)
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"] == before["spec"]
    bad = crd.kubectl(
        "patch",
        "rljob",
        "status",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"phase": "Exploded"}}),
    )
    assert bad.returncode != 0 and "status.phase" in bad.stderr


def test_kubectl_explain_shows_descriptions(crd: Any) -> None:
    result = crd.kubectl("explain", "rljob.spec.policies.rollout.engine")
    assert result.returncode == 0, result.stderr
    assert "vllm" in result.stdout
