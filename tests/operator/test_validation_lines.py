"""`polyrl validate` reports the line of the offending field in a file as a person writes it
(comments, flow mappings, several documents), not the line its document starts on."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyrl_operator.cli import main
from polyrl_operator.validation import validate_file

JOB = """\
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

EXPECTED = {
    "spec.training.totalSteps": 11,  # inside a flow mapping: the key's own line
    "spec.policies[0].rollout.replicas.min": 21,
    "spec.policies[1].model": 23,  # missing: the line of the list item that lacks it
    "spec.policies[1].rollout.replica": 25,  # unknown field: its own line
    "spec.evaluation": 37,  # a rule of spec naming its field: that field's line, not spec's
}


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "lines.yaml"
    path.write_text(JOB)
    return path


def test_each_problem_names_the_line_of_its_field(job_file: Path) -> None:
    found = {p.path: p.line for p in validate_file(job_file).problems}
    for field, line in EXPECTED.items():
        assert found.get(field) == line, (field, found)


def test_the_cli_prints_file_line_and_field(job_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(job_file)]) == 1
    err = capsys.readouterr().err.splitlines()
    for field, line in EXPECTED.items():
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
