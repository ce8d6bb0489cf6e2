"""`polyrl validate` (``polyrl_operator.validation``): every bad input is rejected naming file, line
and field; examples pass. The line is the offending field's in a file as a person writes it
(comments, flow mappings, several documents), not the line its document starts on."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator.cli import main
from polyrl_operator.validation import validate_file
from polyrl_testenv.bad_rljobs import BAD_CASES, EXAMPLES, BadCase, base_job


def _write(tmp_path: Path, name: str, docs: list[object]) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def _deepest_present(doc: Any, field: str) -> str | int | None:
    """The last part of `field` (a printed path: dots and [i]) that `doc` holds; None: not even the
    first. The line a problem at `field` is reported on is that part's."""
    node, found = doc, None
    for part in re.findall(r"[^.\[\]]+", field):
        key: str | int = int(part) if part.isdigit() else part
        in_dict = isinstance(node, dict) and key in node
        in_list = isinstance(node, list) and isinstance(key, int) and key < len(node)
        if not (in_dict or in_list):
            break
        node, found = node[key], key
    return found


def _assert_on_field_line(path: Path, doc: Any, field: str, line: int | None) -> None:
    """`line` is the line in `path` of `field`, or of its deepest ancestor in `doc` (a missing
    field is reported on its parent's line)."""
    assert line is not None
    text = path.read_text().splitlines()[line - 1]
    part = _deepest_present(doc, field)
    if isinstance(part, int):  # a list item starts with "- "
        assert text.lstrip().startswith("- "), (field, line, text)
    else:
        assert part is not None and re.search(rf"(^|[ -]){re.escape(part)}:", text), (field, line, text)


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.id)
def test_bad_input_is_rejected_with_its_field(case: BadCase, tmp_path: Path) -> None:
    doc = case.document()
    path = _write(tmp_path, f"{case.id}.yaml", [doc])
    report = validate_file(path)
    assert report.problems, f"{case.id} was accepted"
    paths = [p.path for p in report.problems]
    assert case.field in paths, f"expected a problem at {case.field}, got {report.problems}"
    for problem in report.problems:
        assert problem.file == str(path)
        # The line of the offending field (of its parent when it is missing), not the document's.
        _assert_on_field_line(path, doc, problem.path, problem.line)


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.id)
def test_cli_exits_nonzero_and_prints_file_and_field(
    case: BadCase, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "job.yaml", [case.document()])
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    [problem] = [p for p in validate_file(path).problems if p.path == case.field][:1]
    assert f"{path}:{problem.line}: {case.field}:" in err
    assert "1 of 1 file(s) invalid" in err


def test_examples_are_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(EXAMPLES)]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok (1 RLJob)") == len(list(EXAMPLES.glob("*.yaml")))


def test_typo_gets_a_suggestion(tmp_path: Path) -> None:
    doc = base_job()
    doc["spec"]["policies"][0]["rollout"]["replica"] = {"min": 1, "max": 1}
    [problem] = validate_file(_write(tmp_path, "j.yaml", [doc])).problems
    assert "did you mean 'replicas'?" in problem.message


def test_multi_document_files_name_the_document_line(tmp_path: Path) -> None:
    good = base_job("good")
    bad = base_job("bad")
    bad["spec"]["mode"] = "turbo"
    other = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}
    path = _write(tmp_path, "multi.yaml", [other, good, bad])
    report = validate_file(path)
    assert report.rljobs == 2
    [problem] = report.problems
    assert problem.path == "spec.mode"
    second_doc_start = path.read_text().splitlines().index("---", 1)
    assert problem.line is not None and problem.line > second_doc_start


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("apiVersion: polyrl.dev/v1alpha1\nkind: RLJob\nspec: {training: [\n")
    [problem] = validate_file(path).problems
    assert "not valid YAML" in problem.message
    assert problem.line is not None


def test_wrong_api_version_is_named(tmp_path: Path) -> None:
    doc = base_job()
    doc["apiVersion"] = "polyrl.dev/v1"
    [problem] = validate_file(_write(tmp_path, "v.yaml", [doc])).problems
    assert problem.path == "apiVersion"


def test_missing_file_is_a_problem_not_a_crash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_yaml12_exponent_floats_are_numbers(tmp_path: Path) -> None:
    # PyYAML's YAML 1.1 reads `1e-6` as a string; kubectl reads it as a number, so must we.
    text = yaml.safe_dump(base_job()).replace("lr: 0.003", "lr: 1e-6")
    assert "lr: 1e-6" in text
    path = tmp_path / "lr.yaml"
    path.write_text(text)
    assert validate_file(path).problems == []


@pytest.mark.parametrize(
    ("api_version", "kind"),
    [
        ("polyrl.dev/v1alpha1", "RLjob"),
        ("polyrl.dev/v1alpha1", "RLJobs"),
        ("polyrl.dev/v1alpha1", "TrainingJob"),
        ("polyrl.dev/v1alpha1", None),
        ("v1", "rljob"),
    ],
)
def test_a_misspelled_kind_is_rejected_naming_file_document_and_kind(
    api_version: str, kind: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = base_job()
    doc["apiVersion"] = api_version
    doc["kind"] = kind
    other = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}
    path = _write(tmp_path, "typo.yaml", [other, doc])
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith(str(path))]
    assert line.startswith(f"{path}:") and ": kind: unknown kind" in line
    assert "document 2" in line and repr(kind) in line and "'RLJob'" in line


def test_other_groups_kinds_are_not_ours(tmp_path: Path) -> None:
    docs: list[object] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "q"}},
    ]
    assert validate_file(_write(tmp_path, "others.yaml", docs)).problems == []


# The line of each field, in a file as a person writes it.
LINES_JOB = """\
# a comment line, then a ConfigMap document
apiVersion: v1
kind: ConfigMap
metadata: {name: other}
---
apiVersion: polyrl.dev/v1alpha1
kind: RLJob
metadata:
  name: fields
spec:
  training: {totalSteps: 0, episodesPerStep: 8}   # line 11
  workflow:
    entrypoint: polyrl_runtime.workflows.signal:SignalGame
  policies:
  - name: a
    model: {uri: builtin://tiny}
    algorithm: {name: grpo, groupSize: 4}
    rollout:
      engine: torch
      gpus: 0
      replicas: {min: 3, max: 1}
    trainer: {backend: deepspeed, gpus: 0}
  - name: b
    algorithm: {name: grpo, groupSize: 4, lr: 1e-3}
    rollout: {engine: torch, gpus: 0, replica: 1}
    trainer: {backend: deepspeed, gpus: 0}
---
apiVersion: polyrl.dev/v1alpha1
kind: RLJob
metadata:
  name: rules
spec:
  maxStaleness: 2
  training: {totalSteps: 3, episodesPerStep: 8}
  workflow:
    entrypoint: polyrl_runtime.workflows.signal:SignalGame
  evaluation:              # line 37: needs data.eval
    everySteps: 5
  policies:
  - name: a
    model: {uri: builtin://tiny}
    algorithm: {name: grpo, groupSize: 4}
    rollout: {engine: torch, gpus: 0}
    trainer: {backend: deepspeed, gpus: 0}
"""

FIELD_LINES = {
    "spec.training.totalSteps": 11,  # inside a flow mapping: the key's own line
    "spec.policies[0].rollout.replicas.min": 21,
    "spec.policies[1].model": 23,  # missing: the line of the list item that lacks it
    "spec.policies[1].rollout.replica": 25,  # unknown field: its own line
    "spec.evaluation": 37,  # a rule of spec naming its field: that field's line, not spec's
}


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "lines.yaml"
    path.write_text(LINES_JOB)
    return path


def test_each_problem_names_the_line_of_its_field(job_file: Path) -> None:
    found = {p.path: p.line for p in validate_file(job_file).problems}
    for field, line in FIELD_LINES.items():
        assert found.get(field) == line, (field, found)


def test_the_cli_prints_file_line_and_field(job_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(job_file)]) == 1
    err = capsys.readouterr().err.splitlines()
    for field, line in FIELD_LINES.items():
        assert any(x.startswith(f"{job_file}:{line}: {field}: ") for x in err), (field, err)


def test_a_wrong_api_version_and_a_misspelled_kind_name_their_own_lines(tmp_path: Path) -> None:
    path = tmp_path / "kinds.yaml"
    path.write_text(
        "# comment\napiVersion: polyrl.dev/v1\nkind: RLJob\n---\n\napiVersion: polyrl.dev/v1alpha1\nkind: RLJobs\n"
    )
    found = {p.path: p.line for p in validate_file(path).problems}
    assert found == {"apiVersion": 2, "kind": 7}


def test_json_files_are_read_and_reported_at_their_document(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text(
        '{"apiVersion": "polyrl.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "x"},\n "spec": {}}'
    )
    problems = validate_file(path).problems
    assert problems and {p.line for p in problems} == {1}
    assert "spec.policies" in {p.path for p in problems}
    path.write_text('{"apiVersion": "polyrl.dev/v1alpha1",\n "kind": }')
    [problem] = validate_file(path).problems
    assert problem.line == 2 and "not valid JSON" in problem.message
