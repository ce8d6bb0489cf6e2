"""Cross-play passes in the driver (coordinator/crossplay.py): the versions of each matrix, the cells'
lines of crossplay.jsonl, their games in the ratings, the pass a frozen row leaves to its column,
failed episodes counted, and a pair that never meets failing the job by name."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from polyrl_operator.api import RLJob
from polyrl_operator.api.data import Data
from polyrl_runtime.coordinator.crossplay import CrossPlayer, cell_row, read_cells, recent_versions
from polyrl_runtime.coordinator.ratings import job_ratings
from polyrl_runtime.data import RowRef
from polyrl_runtime.workflows.crossplay import CrossPlayGame, CrossPlayResult
from polyrl_testenv.bad_rljobs import base_job


def test_the_recent_versions_are_the_current_one_and_the_newest_snapshots() -> None:
    assert recent_versions(5, (0, 2, 4), 3) == [(2, 2), (4, 4), (5, None)]
    assert recent_versions(4, (0, 2, 4), 2) == [(2, 2), (4, 4)]  # the current one, snapshotted
    assert recent_versions(0, (), 3) == [(0, None)]  # no league (or frozen): the current weights


def test_a_cell_line_counts_scores_failures_and_unmatched_episodes() -> None:
    pair = SimpleNamespace(row="a", column="b")
    out: list[CrossPlayResult | str] = [
        CrossPlayResult(1.0, 0.0),
        CrossPlayResult(0.5, 0.5),
        CrossPlayResult(1.0, None),
        "episode x: boom",
    ]
    line = cell_row(3, 0, pair, (2, 5), out)  # type: ignore[arg-type]
    assert line == {
        "step": 3,
        "pair": 0,
        "row": "a",
        "column": "b",
        "row_version": 2,
        "column_version": 5,
        "episodes": 4,
        "scored": 2,
        "failed": 1,
        "unmatched": 1,
        "score": 0.75,
        "row_reward": pytest.approx(0.8333, abs=1e-4),
        "column_reward": 0.25,
    }


class _Worker:
    """A workflow worker's client whose cells the row wins when its version is the higher."""

    def __init__(self, meet: bool = True, fail_every: int = 0) -> None:
        self.dead = self.draining = False
        self.calls: list[tuple[str, int, list[RowRef | None], bool, CrossPlayGame]] = []
        self.meet, self.fail_every = meet, fail_every
        self.actor = self

    async def cross_play(
        self, play_id: str, seed: int, rows: list[RowRef | None], greedy: bool, game: CrossPlayGame
    ) -> list[CrossPlayResult | str]:
        self.calls.append((play_id, seed, rows, greedy, game))
        rv = game.row_version if game.row_version is not None else 99
        cv = game.column_version if game.column_version is not None else 99
        win = 1.0 if rv > cv else 0.0 if rv < cv else 0.5
        out: list[CrossPlayResult | str] = []
        for e in range(len(rows)):
            if self.fail_every and e % self.fail_every == 0:
                out.append(f"episode {play_id}e{e}: failed")
            else:
                out.append(CrossPlayResult(win, 1.0 - win if self.meet else None))
        return out


def _spec(pairs: list[dict[str, str]], frozen_listener: bool = False, **cfg: Any) -> Any:
    doc = base_job()
    doc["spec"]["policies"][0]["algorithm"]["lora"] = {"rank": 4}
    doc["spec"]["policies"][0]["league"] = {"snapshotEverySteps": 1}
    if frozen_listener:
        listener = doc["spec"]["policies"][1]
        listener["frozen"] = True
        listener.pop("trainer", None)
    doc["spec"]["evaluation"] = {"greedy": False, "crossPlay": {"pairs": pairs, "everySteps": 2, **cfg}}
    return RLJob.model_validate(doc).spec


def _player(spec: Any, tmp_path: Path, worker: _Worker, failed: list[str], **versions: Any) -> CrossPlayer:
    assert spec.evaluation.cross_play is not None
    return CrossPlayer(
        spec,
        spec.evaluation.cross_play,
        rows=[{"q": 1}, {"q": 2}],
        fleet=SimpleNamespace(workers={"w0": worker}),  # type: ignore[arg-type]
        versions=lambda p: versions[p],
        ratings=job_ratings(spec),
        out_dir=tmp_path,
        fail=failed.append,
    )


def test_a_pass_plays_every_cell_writes_its_lines_and_rates_the_versions(tmp_path: Path) -> None:
    spec = _spec([{"row": "speaker", "column": "speaker"}], episodes=3)
    spec.data = Data(train="file:///train.jsonl", eval="file:///eval.jsonl")
    worker, failed = _Worker(), []
    xp = _player(spec, tmp_path, worker, failed, speaker=[(2, 2), (4, None)])
    assert xp.due("speaker", 1, last=False) == [] and xp.due("listener", 2, last=False) == []
    assert xp.due("speaker", 2, last=False) == [0] == xp.due("speaker", 3, last=True)
    asyncio.run(xp.at_step("speaker", 2, last=False))
    cells = read_cells(tmp_path / "crossplay.jsonl")
    assert [(c["row_version"], c["column_version"], c["score"]) for c in cells] == [
        (2, 2, 0.5),
        (2, 4, 0.0),
        (4, 2, 1.0),
        (4, 4, 0.5),
    ]
    games = [call[4] for call in worker.calls]
    assert {(g.row_version, g.column_version) for g in games} == {(2, 2), (2, None), (None, 2), (None, None)}
    # every cell plays the same rows and seed (comparable), sampled as evaluation.greedy says
    assert {call[1] for call in worker.calls} == {worker.calls[0][1]} and not worker.calls[0][3]
    assert [r.index if r else None for r in worker.calls[0][2]] == [0, 1, 0]
    ratings = xp.ratings.ratings()
    assert ratings[("speaker", 4)] > ratings[("speaker", 2)] and not failed


def test_a_frozen_row_leaves_the_pass_to_the_column_and_failures_are_counted(tmp_path: Path) -> None:
    spec = _spec([{"row": "listener", "column": "speaker"}], frozen_listener=True, anchor="listener")
    worker, failed = _Worker(fail_every=2), []
    xp = _player(spec, tmp_path, worker, failed, listener=[(0, None)], speaker=[(0, 0), (2, None)])
    assert xp.due("speaker", 2, last=False) == [0]
    asyncio.run(xp.at_step("speaker", 2, last=False))
    cells = read_cells(tmp_path / "crossplay.jsonl")
    assert [(c["failed"], c["scored"]) for c in cells] == [(2, 2), (2, 2)] and not failed
    assert all(call[2] == [None] * 4 for call in worker.calls)  # no data.eval: no rows
    ratings = xp.ratings.ratings()  # the frozen listener anchors the group
    # the fake worker plays the current weights as the strongest: the speaker's version 2 ties it
    assert ratings[("listener", 0)] == 1000.0 == pytest.approx(ratings[("speaker", 2)])
    assert ratings[("speaker", 0)] < 1000.0


def test_a_pair_that_never_meets_fails_the_job_naming_it(tmp_path: Path) -> None:
    spec = _spec([{"row": "speaker", "column": "listener"}])
    failed: list[str] = []
    xp = _player(spec, tmp_path, _Worker(meet=False), failed, speaker=[(2, None)], listener=[(2, None)])
    asyncio.run(xp.at_step("speaker", 2, last=False))
    assert len(failed) == 1 and failed[0].startswith("spec.evaluation.crossPlay.pairs[0]: in 4 cross-play")
    assert (
        "never meet" in failed[0] and json.loads((tmp_path / "crossplay.jsonl").read_text())["unmatched"] == 4
    )
