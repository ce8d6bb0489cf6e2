"""`polyrl run` across an interrupt, a run that fails at start and a resume, as a user runs it.

- The first step after `--resume` reports real rewards (the reward window is part of the checkpoint:
  that step may train on the checkpoint's buffered samples before any new episode arrives; with
  maxStaleness 4 an interrupted run's checkpoint holds steps of them).
- The summary's first reward is the first run's first; its last is the last step's.
- A run that fails before it started leaves the previous results (summary.json included) as they were
  and writes its summary to summary.failed.json; the next run that starts removes that file.
- The summary lists only result files that exist; output to a file has no ANSI codes.
- While it starts, the run says what it does; the summary gives each start-up phase's duration.
- `--quiet` prints only the summary.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_testenv.localrun import Background, metrics_rows, polyrl_run

DATA = Path(__file__).parent.parent / "data"
PHASES = ["ray", "actors", "model_load", "trainer_init", "first_weights"]


def _job(tmp: Path, name: str, total: int, **policy: Any) -> Path:
    doc = yaml.safe_load((DATA / "selfplay-tiny.yaml").read_text())
    doc["spec"]["training"]["totalSteps"] = total
    doc["spec"]["maxStaleness"] = 4  # episodes run ahead: the checkpoint holds whole steps of samples
    doc["spec"]["policies"][0].update(policy)
    path = tmp / name
    path.write_text(yaml.safe_dump(doc))
    return path


def _summary(out: Path, name: str = "summary.json") -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / name).read_text())
    return doc


@pytest.mark.slow
def test_interrupt_failed_start_and_resume_keep_the_results_whole(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # 1. A run interrupted after a few steps (async: its checkpoint holds buffered samples).
    first = Background(
        tmp_path / "first", str(_job(tmp_path, "long.yaml", 500)), "--out", str(out), "--plain"
    )
    first.wait_for_rows(out, 2)
    first.proc.send_signal(signal.SIGINT)
    assert first.finish() == 130, first.stdout + first.stderr
    stdout = first.stdout
    assert "\x1b[" not in stdout + first.stderr  # to a file: no colour codes, logs included
    for doing in (
        "starting selfplay: a local Ray cluster ...",
        "starting actors (1 engine (1 in its trainer's process), 1 trainer rank, 1 workflow worker) ...",
        "loading the models into the rollout engines ...",
        "initialising the trainers (process groups, models, DeepSpeed) ...",
        "first weight sync to the engines (objectstore) ...",
    ):
        assert doing in stdout
    assert stdout.index("first weight sync") < stdout.index("running selfplay")
    summary = _summary(out)
    assert list(summary["startup"]) == PHASES and all(s > 0 for s in summary["startup"].values())
    assert "   start-up: ray " in stdout and ", first weights " in stdout
    steps = summary["steps"]["agent"]
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert summary["first_reward"]["agent"] == rows[0]["reward_mean"] is not None
    assert summary["files"] == ["metrics.jsonl", "metrics.csv", "reward_agent.png"]
    assert f"   metrics: {out / 'metrics.jsonl'}, {out / 'metrics.csv'}" in stdout
    before = {name: (out / name).read_bytes() for name in ("summary.json", "metrics.jsonl", "metrics.csv")}

    # 2. A fresh run into the same folder that fails at start (its model cannot be loaded).
    broken = _job(tmp_path, "broken.yaml", 500, model={"uri": "file:///nowhere/model"})
    r = polyrl_run(str(broken), "--out", str(out), "--quiet")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "starting actors" not in r.stdout and "== failed: policy agent" in r.stdout  # only the summary
    assert "policy agent: file:///nowhere/model" in r.stderr
    assert {name: (out / name).read_bytes() for name in before} == before
    assert (out / "checkpoints" / f"step-{steps:06d}" / "state.json").is_file()
    failed = _summary(out, "summary.failed.json")
    assert failed["state"] == "failed" and "file:///nowhere/model" in failed["message"]
    # Where it stopped: the engine shares its trainer's process, so its model loads as the actors start.
    assert list(failed["startup"]) == ["ray", "actors"]
    assert f"summary: {out / 'summary.failed.json'} (the run failed before it started" in r.stdout
    assert f"the previous results are unchanged ({out / 'summary.json'})" in r.stdout
    assert "metrics:" not in r.stdout  # this run wrote none

    # 3. The interrupted run resumed for two more steps.
    r = polyrl_run(str(_job(tmp_path, "more.yaml", steps + 2)), "--out", str(out), "--plain", "--resume")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = metrics_rows(out)
    assert [x["step"] for x in rows] == list(range(1, steps + 3))
    for resumed in rows[steps:]:  # the steps after the resume, the first ones on restored samples
        assert resumed["reward_mean"] is not None and resumed["success_mean"] is not None, resumed
    summary = _summary(out)
    assert summary["first_reward"]["agent"] == rows[0]["reward_mean"]  # the first run's first
    assert summary["last_reward"]["agent"] == rows[-1]["reward_mean"]
    assert summary["first_success"]["agent"] == rows[0]["success_mean"]
    assert f"reward {rows[0]['reward_mean']:.3f} -> {rows[-1]['reward_mean']:.3f}" in r.stdout
    assert not (out / "summary.failed.json").exists()
    assert summary["files"] == ["metrics.jsonl", "metrics.csv", "reward_agent.png"]
