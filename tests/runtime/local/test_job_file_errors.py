"""`polyrl run` reports a bad job file exactly as `polyrl validate` does: the same field paths
(`spec.evaluation`, not `spec`), the same lines and the same words, before it starts anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

from polyrl_testenv.localrun import POLYRL, polyrl_run, run_env

BAD = """\
apiVersion: polyrl.dev/v1alpha1
kind: RLJob
metadata: {name: bad}
spec:
  training: {totalSteps: 3, episodesPerStep: 8}
  workflow: {entrypoint: polyrl_runtime.workflows.signal:SignalGame}
  evaluation:
    everySteps: 2
  policies:
  - name: a
    model: {uri: builtin://tiny}
    algorithm: {name: grpo, groupSize: 4}
    rollout: {engine: torch, gpus: 0}
    trainer: {backend: deepspeed, gpus: 0}
"""


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [POLYRL, "validate", str(path)], capture_output=True, text=True, env=run_env(), check=False
    )


def test_run_and_validate_name_the_same_field_on_the_same_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    checked = _validate(path)
    assert checked.returncode == 1
    problems = [x for x in checked.stderr.splitlines() if x.startswith(str(path))]
    want = "needs eval rows: set data.eval (or evaluation.crossPlay alone, for games without rows)"
    assert problems == [f"{path}:7: spec.evaluation: {want}"]
    ran = polyrl_run(str(path), "--out", str(tmp_path / "out"))
    assert ran.returncode == 2
    assert ran.stderr.splitlines() == [f"error: {p}" for p in problems]
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_every_problem_of_the_file_is_one_error_line(tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(
        BAD.replace("  evaluation:\n    everySteps: 2\n", "").replace("totalSteps: 3", "totalSteps: 0")
    )
    path.write_text(path.read_text().replace("engine: torch", "engine: sglang"))
    checked = [x for x in _validate(path).stderr.splitlines() if x.startswith(str(path))]
    assert len(checked) == 2 and any("spec.training.totalSteps" in x for x in checked)
    ran = polyrl_run(str(path))
    assert ran.returncode == 2 and ran.stderr.splitlines() == [f"error: {p}" for p in checked]
