"""Cross-play passes (`spec.evaluation.crossPlay`): how version i of one policy fares against version j
of another, or of itself, as a matrix per pair of policies.

A pair's pass runs at every `everySteps` steps of its first trained policy (row, unless the row is
frozen), and at that policy's last step, beside the evaluation pass of the same step. Its versions
per policy: the current one (what its engines serve) and the league's newest snapshots, `versions`
at most; a frozen policy has version 0 only. Each cell plays `episodes` episodes on the workflow
workers (workflows/crossplay.py), outside the buffer, greedy or sampled as `evaluation.greedy` says;
every cell plays the same rows and seeds, so cells compare.

A cell's score is the row version's mean over its episodes of 1 (its side's reward above the
column side's), 0.5 (equal) or 0; the cells go to `<out>/crossplay.jsonl`, one line each, and their
games to the job's ratings (coordinator/ratings.py). A failed episode is counted in its cell, never
fatal; a pass in which no episode had agents of both sides fails the job naming the pair: its
policies never meet in the workflow.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from polyrl_operator.api import CrossPlay, CrossPlayPair, RLJobSpec
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.ratings import RatingBook
from polyrl_runtime.data import RowRef
from polyrl_runtime.workflows.crossplay import CrossPlayGame, CrossPlayResult

log = structlog.get_logger(__name__)

CROSSPLAY_FILE = "crossplay.jsonl"
CELLS_AT_ONCE = 16  # cells played at once: enough to batch in the engines, bounded for big matrices
Versions = Callable[[str], Sequence[tuple[int, int | None]]]  # policy -> (version, snapshot or None)


def read_cells(path: Path) -> list[dict[str, Any]]:
    """The cells of a crossplay.jsonl, in the order they were played (none when there is no file; a
    last line cut short by a killed process is left out)."""
    if not path.is_file():
        return []
    cells = []
    for line in path.read_text().splitlines():
        try:
            cells.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("crossplay.unreadable_line", file=str(path))
    return cells


def recent_versions(current: int, held: Sequence[int], n: int) -> list[tuple[int, int | None]]:
    """A policy's `n` newest versions among its current one and its held snapshots, oldest first,
    each with the snapshot that plays it (None: the current weights, when no snapshot holds them)."""
    return [(v, v if v in held else None) for v in sorted({*held, current})[-n:]]


def cell_row(
    step: int,
    index: int,
    pair: CrossPlayPair,
    versions: tuple[int, int],
    out: Sequence[CrossPlayResult | str],
) -> dict[str, Any]:
    """One cell's line of crossplay.jsonl from its episodes' results (or errors)."""
    done = [r for r in out if isinstance(r, CrossPlayResult)]
    scores = [s for r in done if (s := r.score) is not None]
    rows = [r.row_reward for r in done if r.row_reward is not None]
    cols = [r.column_reward for r in done if r.column_reward is not None]
    return {
        "step": step,
        "pair": index,
        "row": pair.row,
        "column": pair.column,
        "row_version": versions[0],
        "column_version": versions[1],
        "episodes": len(out),
        "scored": len(scores),
        "failed": len(out) - len(done),
        "unmatched": len(done) - len(scores),  # episodes with no rewarded agent on a side
        "score": round(sum(scores) / len(scores), 4) if scores else None,
        "row_reward": round(sum(rows) / len(rows), 4) if rows else None,
        "column_reward": round(sum(cols) / len(cols), 4) if cols else None,
    }


class CrossPlayer:
    def __init__(
        self,
        spec: RLJobSpec,
        cfg: CrossPlay,
        *,
        rows: list[dict[str, Any]],
        fleet: Fleet,
        versions: Versions,
        ratings: RatingBook,
        out_dir: Path,
        fail: Callable[[str], None],
    ) -> None:
        self.cfg, self.rows, self.fleet, self.versions, self.ratings = cfg, rows, fleet, versions, ratings
        self.source = spec.data.eval if spec.data is not None else None
        self.greedy = spec.evaluation.greedy if spec.evaluation is not None else True
        self.seed, self.entrypoint = spec.training.seed, spec.workflow.entrypoint
        frozen = {p.name for p in spec.policies if p.frozen}
        # each pair's pass follows its first trained policy's steps
        self.trigger = [x.row if x.row not in frozen else x.column for x in cfg.pairs]
        self.path, self._fail = out_dir / CROSSPLAY_FILE, fail

    def due(self, policy: str, step: int, last: bool) -> list[int]:
        """The pairs whose pass this step of `policy` plays."""
        if not (last or step % self.cfg.every_steps == 0):
            return []
        return [i for i, p in enumerate(self.trigger) if p == policy]

    async def at_step(self, policy: str, step: int, last: bool) -> None:
        for i in self.due(policy, step, last):
            await self._pass(i, step)

    def _episode_rows(self) -> list[RowRef | None]:
        if not self.rows or self.source is None:
            return [None] * self.cfg.episodes
        n = len(self.rows)
        return [RowRef(self.source, e % n, self.rows[e % n]) for e in range(self.cfg.episodes)]

    async def _pass(self, index: int, step: int) -> list[dict[str, Any]]:
        pair = self.cfg.pairs[index]
        cells = [(r, c) for r in self.versions(pair.row) for c in self.versions(pair.column)]
        gate = asyncio.Semaphore(CELLS_AT_ONCE)
        rows = self._episode_rows()
        seed = (self.seed * 1_000_003 + 7919) % 2**31  # the same draws in every cell and pass

        async def play(k: int, r: tuple[int, int | None], c: tuple[int, int | None]) -> dict[str, Any]:
            game = CrossPlayGame(pair.row, pair.column, r[1], c[1])
            async with gate:
                out = await self._play(k, f"xp{step}p{index}c{k}", seed, rows, game)
            return cell_row(step, index, pair, (r[0], c[0]), out)

        lines = await asyncio.gather(*(play(k, r, c) for k, (r, c) in enumerate(cells)))
        with self.path.open("a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
        for line in lines:
            if line["scored"]:
                a, b = (pair.row, line["row_version"]), (pair.column, line["column_version"])
                self.ratings.add(a, b, line["score"] * line["scored"], line["scored"])
        log.info(
            "crossplay.pass",
            pair=index,
            row=pair.row,
            column=pair.column,
            step=step,
            cells={f"{x['row_version']}x{x['column_version']}": x["score"] for x in lines},
            failed=sum(x["failed"] for x in lines),
        )
        self._check_met(index, pair, lines)
        return lines

    async def _play(
        self, k: int, play_id: str, seed: int, rows: list[RowRef | None], game: CrossPlayGame
    ) -> list[CrossPlayResult | str]:
        workers = [w for w in self.fleet.workers.values() if not w.dead and not w.draining]
        if not workers:
            return [f"cross-play {play_id}: no workflow worker"] * len(rows)
        worker = workers[k % len(workers)]  # the cells spread over the workers
        try:
            return await worker.actor.cross_play(play_id, seed, rows, self.greedy, game)
        except Exception as e:
            return [f"cross-play {play_id}: {(str(e).splitlines() or [repr(e)])[0]}"] * len(rows)

    def _check_met(self, index: int, pair: CrossPlayPair, lines: Sequence[Mapping[str, Any]]) -> None:
        unmatched = sum(x["unmatched"] for x in lines)
        if unmatched and not any(x["scored"] for x in lines):
            column = f"{pair.column} (as ctx.opponent)" if pair.row == pair.column else pair.column
            self._fail(
                f"spec.evaluation.crossPlay.pairs[{index}]: in {unmatched} cross-play episodes of "
                f"workflow {self.entrypoint}, no episode rewarded agents of both {pair.row} and "
                f"{column}: the two never meet in the workflow (pair policies whose agents play "
                f"one episode)"
            )
