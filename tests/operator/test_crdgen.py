"""The CRD generated from the models: committed copy up to date, structural, documented, consistent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polyrl_operator import crdgen
from polyrl_operator.api import RLJob
from polyrl_operator.cli import CRD_DIRS, main
from polyrl_testenv.bad_rljobs import REPO, base_job

CRD = crdgen.build_crd()
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{*}}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[*]")


def test_committed_crd_matches_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crds", "check", "--dir", str(REPO / "crds")]) == 0, capsys.readouterr().err


def test_every_committed_copy_is_checked_and_generated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The kustomize base and the chart vendor the CRD: `polyrl crds generate` (as `make crds` runs it,
    at the repository root) writes every copy, and `make test`'s check covers every one (a copy left
    stale would install an old schema)."""
    monkeypatch.chdir(REPO)
    assert main(["crds", "check"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert all(f"{d}/{crdgen.CRD_FILENAME}: up to date" in out for d in CRD_DIRS)
    monkeypatch.chdir(tmp_path)
    assert main(["crds", "generate"]) == 0
    assert main(["crds", "check"]) == 0
    (tmp_path / CRD_DIRS[-1] / crdgen.CRD_FILENAME).write_text("stale\n")
    assert main(["crds", "check"]) == 1
    assert f"{CRD_DIRS[-1]}/{crdgen.CRD_FILENAME}: differs" in capsys.readouterr().err


def test_check_reports_drift(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    crdgen.generate(tmp_path)
    path = tmp_path / crdgen.CRD_FILENAME
    path.write_text(path.read_text().replace("default: 64", "default: 65"))
    assert main(["crds", "check", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "differs" in err and "polyrl crds generate" in err
    assert "default: 65" in err and "default: 64" in err


def test_check_reports_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crds", "check", "--dir", str(tmp_path)]) == 1
    assert "missing" in capsys.readouterr().err


def test_schema_is_structural() -> None:
    for path, node in _walk(SCHEMA):
        assert "$ref" not in node and "title" not in node and "$defs" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            continue
        assert "anyOf" not in node and "oneOf" not in node and "allOf" not in node, path
        assert "type" in node, f"{path} has no type"
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert node["type"] == "object", path
        if node["type"] == "object" and path not in {".metadata"}:
            assert (
                "properties" in node
                or "additionalProperties" in node
                or node.get("x-kubernetes-preserve-unknown-fields")
            ), path


def test_every_field_has_a_description() -> None:
    for path, node in _walk(SCHEMA):
        if path in {".metadata"} or path.endswith(("{*}", "[*]")):
            continue
        assert node.get("description"), f"{path} has no description (kubectl explain shows it)"


def test_free_form_only_where_intended() -> None:
    free = {p for p, n in _walk(SCHEMA) if n.get("x-kubernetes-preserve-unknown-fields")}
    assert free == {
        ".spec.workflow.args",
        ".spec.workflow.env[*].valueFrom",
        ".spec.workflow.podTemplate.spec",
        ".spec.policies[*].rollout.env[*].valueFrom",
        ".spec.policies[*].rollout.podTemplate.spec",
        ".spec.policies[*].rollout.engineArgs",
        ".spec.policies[*].trainer.env[*].valueFrom",
        ".spec.policies[*].trainer.podTemplate.spec",
        ".spec.coordinator.env[*].valueFrom",
        ".spec.coordinator.podTemplate.spec",
        ".spec.pools[*].env[*].valueFrom",
        ".spec.pools[*].podTemplate.spec",
    }


def test_names_printer_columns_and_subresources() -> None:
    spec = CRD["spec"]
    assert spec["names"]["shortNames"] == ["rlj"]
    assert spec["names"]["categories"] == ["polyrl", "all"]
    version = spec["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert [name for name, c in columns.items() if "priority" not in c] == [
        "Phase",
        "Policies",
        "Step",
        "Age",
    ]
    assert columns["Policies"]["jsonPath"] == ".status.policySummary"
    assert columns["Pools"] == {**columns["Pools"], "jsonPath": ".status.poolSummary", "priority": 1}
    assert columns["Ratings"] == {**columns["Ratings"], "jsonPath": ".status.ratingSummary", "priority": 1}
    for name, path in (("Started", ".status.startTime"), ("Completed", ".status.completionTime")):
        assert columns[name]["type"] == "date" and columns[name]["jsonPath"] == path
    # Every column reads a field the schema has: a column on a missing field stays empty forever.
    for column in columns.values():
        node = SCHEMA
        for part in column["jsonPath"].lstrip(".").split("."):
            if part == "metadata":
                break
            node = node["properties"][part]


def test_cel_rules_are_emitted_where_their_models_sit() -> None:
    rules = {p: [r["rule"] for r in n.get("x-kubernetes-validations", [])] for p, n in _walk(SCHEMA)}
    assert any("metadata.name" in r for r in rules[""])
    assert rules[".spec.policies[*].rollout.replicas"] == ["self.min <= self.max"]
    assert rules[".spec.workflow.replicas"] == ["self.min <= self.max"]
    assert any("vllm" in r for r in rules[".spec.policies[*].rollout"])
    assert any("grpo" in r for r in rules[".spec.policies[*].algorithm"])
    policies = SCHEMA["properties"]["spec"]["properties"]["policies"]
    assert policies["x-kubernetes-list-type"] == "map"
    assert policies["x-kubernetes-list-map-keys"] == ["name"]


def test_status_has_no_defaults() -> None:
    for path, node in _walk(SCHEMA["properties"]["status"]):
        assert "default" not in node, path


def _apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """What the API server's structural defaulting does (absent field with a default gets it)."""
    if isinstance(obj, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in obj and "default" in sub:
                obj[name] = sub["default"]
            if name in obj:
                obj[name] = _apply_defaults(sub, obj[name])
    elif isinstance(obj, list) and "items" in schema:
        return [_apply_defaults(schema["items"], x) for x in obj]
    return obj


def test_crd_defaults_agree_with_model_defaults() -> None:
    doc = base_job()
    spec = doc["spec"]
    for key in ("weightSync", "checkpoint", "maxStaleness"):
        spec.pop(key, None)
    for policy in spec["policies"]:
        policy.pop("algorithm")
        policy["trainer"] = {"gpus": 0}
        policy["rollout"] = {"engine": "torch", "gpus": 0}
    server_view = _apply_defaults(SCHEMA, {**doc, "spec": dict(spec)})
    model_view = RLJob.model_validate(doc).to_k8s()
    # Everything the model fills in by default, the server fills in identically (and vice versa).
    assert RLJob.model_validate(server_view).to_k8s() == model_view
    assert server_view["spec"]["weightSync"] == model_view["spec"]["weightSync"]
    assert server_view["spec"]["policies"][0]["algorithm"] == model_view["spec"]["policies"][0]["algorithm"]
    assert server_view["spec"]["policies"][0]["trainer"] == model_view["spec"]["policies"][0]["trainer"]


def test_exclusive_bounds_use_the_openapi_v3_form() -> None:
    # The API server reads exclusiveMinimum/exclusiveMaximum as booleans beside minimum/maximum; the
    # draft-2020 number form (what pydantic emits for gt=/lt=) makes it refuse the whole CRD.
    found = 0
    for path, node in _walk(SCHEMA):
        for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if exclusive in node:
                found += 1
                assert node[exclusive] is True and bound in node, (path, node)
    assert found >= 2  # gt= (lr) and lt= (lora dropout) both occur in the API
