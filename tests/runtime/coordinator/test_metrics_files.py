"""The per-step metrics series (coordinator/metrics/files.py): one row per (policy, step), kept in a
local file or in rolling part files in an object store, continued without duplicates on resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from polyrl_runtime import storage
from polyrl_runtime.coordinator.metrics.files import LOCAL_NAME, MetricsFile, read_metrics, unique_rows


def _row(policy: str, step: int, loss: float = 0.0) -> dict[str, Any]:
    return {"policy": policy, "step": step, "loss": loss}


@pytest.mark.parametrize(
    ("rows", "steps", "want"),
    [
        ([], None, []),
        ([_row("a", 1), _row("a", 2)], None, [_row("a", 1), _row("a", 2)]),
        # a step written twice (trained again after a resume): the last row wins
        ([_row("a", 1, 1.0), _row("a", 2), _row("a", 1, 9.0)], None, [_row("a", 1, 9.0), _row("a", 2)]),
        # resume at a:1, b:2: later steps go; a policy the checkpoint lacks keeps nothing
        (
            [_row("a", 1), _row("b", 1), _row("a", 2), _row("b", 2), _row("c", 1)],
            {"a": 1, "b": 2},
            [_row("a", 1), _row("b", 1), _row("b", 2)],
        ),
        ([_row("a", 1)], {}, []),  # a fresh start
        ([_row("b", 2), _row("a", 1), _row("b", 1)], None, [_row("a", 1), _row("b", 1), _row("b", 2)]),
    ],
    ids=["empty", "plain", "rewritten-step", "resume", "fresh", "ordered-by-step"],
)
def test_unique_rows(
    rows: list[dict[str, Any]], steps: dict[str, int] | None, want: list[dict[str, Any]]
) -> None:
    assert unique_rows(rows, steps) == want


def test_a_local_series_is_appended_row_by_row_and_continued_after_the_checkpoints_steps(
    tmp_path: Path,
) -> None:
    first = MetricsFile(tmp_path)
    assert first.open({}) == 0
    for step in (1, 2, 3):
        assert first.add(_row("a", step)) is False  # a local file never waits for a flush
        # on disk at once: a process killed now loses nothing it reported
        assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, step + 1))
    with (tmp_path / LOCAL_NAME).open("a") as f:
        f.write('{"policy": "a", "st')  # the line a killed process was writing
    second = MetricsFile(tmp_path)
    assert second.open({"a": 2}) == 2  # the checkpoint holds step 2: step 3 is trained again
    second.add(_row("a", 3, 7.0))
    second.close()
    lines = [json.loads(line) for line in (tmp_path / LOCAL_NAME).read_text().splitlines()]
    assert lines == [_row("a", 1), _row("a", 2), _row("a", 3, 7.0)]
    fresh = MetricsFile(tmp_path)
    assert fresh.open({}) == 0 and read_metrics(tmp_path) == []  # no checkpoint: a new series


def test_an_object_store_series_rolls_part_files_and_resumes_without_duplicates(bucket: str) -> None:
    d = f"s3://{bucket}/jobs/m/metrics"
    first = MetricsFile(d, flush_s=0.0, part_rows=2)
    assert first.open({}) == 0
    for step in (1, 2, 3):
        assert first.add(_row("a", step)) is True  # flush_s 0: every row is due
        first.flush()
    assert storage.list_names(d) == ["part-00000.jsonl", "part-00001.jsonl"]  # 2 rows, then a new part
    assert [r["step"] for r in read_metrics(d)] == [1, 2, 3]
    first.add(_row("a", 4))  # not flushed: lost with the pod, like the steps after the checkpoint

    second = MetricsFile(d, flush_s=3600.0, part_rows=2)
    assert second.open({"a": 2}) == 2
    # the kept rows as one new part; the old parts are gone
    assert storage.list_names(d) == ["part-00002.jsonl"]
    assert second.add(_row("a", 3, 5.0)) is False  # not due yet: batched
    assert [r["step"] for r in read_metrics(d)] == [1, 2]
    second.close()  # the end of the run stores the rest
    assert read_metrics(d) == [_row("a", 1), _row("a", 2), _row("a", 3, 5.0)]
    rows = [json.loads(x) for x in storage.read_bytes(f"{d}/part-00002.jsonl").decode().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # written once each

    third = MetricsFile(d, flush_s=0.0)
    assert third.open({"a": 3}) == 3
    assert storage.list_names(d) == ["part-00002.jsonl"]  # nothing to drop: the same part continues
    third.add(_row("a", 4))
    third.close()
    assert [r["step"] for r in read_metrics(d)] == [1, 2, 3, 4]
