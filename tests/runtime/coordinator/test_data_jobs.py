"""Data-driven jobs end to end on a local Ray with the tiny model: every group plays one row, a
resumed job neither repeats nor skips rows, training ends when the epochs run out, and bad input
(an unreadable file, a missing field, a reward function that raises) is reported clearly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from driver_harness import make_job, run

from polyrl_operator.api import RLJob

pytestmark = pytest.mark.slow
GROUP = 4  # selfplay-tiny.yaml's groupSize


def data_file(tmp: Path, n: int, **extra: Any) -> str:
    path = tmp / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"id": i, "prompt": f"{i}+0=", "answer": i, **extra}) + "\n" for i in range(n))
    )
    return f"file://{path}"


def data_job(
    tmp: Path, *, steps: int, rows: int = 40, epochs: int | None = None, reward: str = "numeric", **data: Any
) -> RLJob:
    return make_job(
        mode="sync",
        maxStaleness=0,
        training={"totalSteps": steps, "episodesPerStep": 2 * GROUP},
        workflow={
            "entrypoint": "data_workflows:LoggedPrompt",
            "args": {"log": str(tmp / "rows.log"), "reward": reward, "max_new_tokens": 2},
        },
        data={"train": data_file(tmp, rows), "epochs": epochs, **data},
        checkpoint={"everySteps": 1, "keep": 5},
    )


def played(tmp: Path) -> list[list[int]]:
    """Row ids per group, in the order the groups finished; every member of a group played one row."""
    groups: dict[str, list[int]] = {}
    for line in (tmp / "rows.log").read_text().splitlines():
        g, row = line.split()
        groups.setdefault(g, []).append(int(row))
    for g, rows in groups.items():
        assert rows == [rows[0]] * GROUP, (g, rows)  # one row per GRPO group
    return [rows[:1] for rows in groups.values()]


def steps_of_rows(tmp: Path) -> list[set[int]]:
    rows = [r[0] for r in played(tmp)]
    return [set(rows[i : i + 2]) for i in range(0, len(rows), 2)]  # 2 groups per sync step


def test_resumed_job_neither_repeats_nor_skips_rows(ray_local: Any, tmp_path: Path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    whole.mkdir(), split.mkdir()
    _, a = run(data_job(whole, steps=4), whole)
    assert a.state == "done", a.message
    _, b1 = run(data_job(split, steps=2), split)
    assert b1.state == "done", b1.message
    _, b2 = run(data_job(split, steps=4), split)  # resumes from the step-2 checkpoint
    assert b2.state == "done" and b2.steps == {"agent": 4}, b2.message
    assert steps_of_rows(whole) == steps_of_rows(split)
    assert len({r for s in steps_of_rows(whole) for r in s}) == 8  # 8 distinct rows, shuffled
    assert [r for s in steps_of_rows(whole) for r in sorted(s)] != list(range(8))


def test_training_ends_when_the_epochs_run_out(ray_local: Any, tmp_path: Path) -> None:
    _, summary = run(data_job(tmp_path, steps=50, rows=6, epochs=2), tmp_path)
    assert summary.state == "done", summary.message
    assert summary.steps == {"agent": 6}  # 2 epochs x 6 rows = 12 groups, 2 per step
    assert "train data exhausted: 2 epoch(s)" in summary.message
    rows = [r[0] for r in played(tmp_path)]
    assert sorted(rows[:6]) == sorted(rows[6:]) == list(range(6))


def test_unreadable_data_fails_at_start_without_retry(ray_local: Any, tmp_path: Path) -> None:
    job = data_job(tmp_path, steps=2)
    assert job.spec.data is not None
    job.spec.data.train = f"file://{tmp_path}/missing.jsonl"
    _, summary = run(job, tmp_path)
    assert summary.state == "failed" and summary.records == []
    assert f"spec.data.train: file://{tmp_path}/missing.jsonl: cannot read the data file" in summary.message
    assert not (tmp_path / "rows.log").exists()


@pytest.mark.parametrize(
    ("reward", "row_field", "expected"),
    [
        (
            "data_workflows:explode",
            "",
            "reward function 'data_workflows:explode' raised ValueError: cannot score",
        ),
        ("numeric", "prompt", "train.jsonl row "),
    ],
)
def test_bad_rows_and_rewards_are_counted_drops_then_fail(
    ray_local: Any, tmp_path: Path, reward: str, row_field: str, expected: str
) -> None:
    job = data_job(tmp_path, steps=2, reward=reward)
    assert job.spec.data is not None
    if row_field:  # rows without the field the workflow reads
        path = tmp_path / "train.jsonl"
        path.write_text("".join(json.dumps({"id": i, "answer": i}) + "\n" for i in range(8)))
    _, summary = run(job, tmp_path, max_consecutive_failures=8)
    assert summary.state == "failed", summary.message
    assert "8 episodes in a row failed; last: episode g" in summary.message and expected in summary.message
    if row_field:
        assert "no field 'prompt' (the row has ['answer', 'id'])" in summary.message
    reason = "reward_error" if not row_field else "workflow_error"
    assert summary.failed.get(reason, 0) >= 8
