"""Evaluation: before the first step (`evaluation.beforeTraining`, step 0: the initial weights), every
`evaluation.everySteps` steps, and at a policy's last step, the current weights
of the policies play the `data.eval` rows, `k` episodes per row (greedy or sampled), on the workflow
workers but outside the buffer: nothing is trained on them.

Per policy a pass gives the mean raw reward over the eval episodes and pass@k, the fraction of rows
where at least one of the k episodes reached `passThreshold`. Each policy's trainer asks for the
pass of its step (`at_step`) and puts its own result in that step's record; policies that reach the
same step share one pass. A failed eval episode is counted, never fatal: evaluation must not end a
run that trains. The cross-play passes of a step (coordinator/crossplay.py) run first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from polyrl_operator.api.progress import EvalProgress
from polyrl_operator.api.spec import RLJobSpec
from polyrl_runtime.coordinator.crossplay import CrossPlayer
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.data import DataError, RowRef, load_rows

log = structlog.get_logger(__name__)

ROWS_PER_WAVE = 32  # eval rows played at once: enough to batch in the engines, bounded for big sets


@dataclass(frozen=True)
class EvalResult:
    policy: str
    step: int
    reward_mean: float | None
    pass_at_k: float | None
    k: int
    rows: int  # rows with at least one finished episode of the policy
    failed: int  # eval episodes that failed

    def progress(self) -> EvalProgress:
        """The pass as /progress and the RLJob status report it."""
        return EvalProgress(
            step=self.step, reward_mean=self.reward_mean, pass_at_k=self.pass_at_k, k=self.k, rows=self.rows
        )


def summarize(
    policy: str, step: int, k: int, per_row: Sequence[Sequence[Mapping[str, float] | str]], threshold: float
) -> EvalResult:
    """One policy's result from each row's episode outcomes (rewards per policy, or an error)."""
    rewards: list[float] = []
    solved, rows, failed = 0, 0, 0
    for episodes in per_row:
        mine = [e[policy] for e in episodes if not isinstance(e, str) and policy in e]
        failed += sum(isinstance(e, str) for e in episodes)
        if mine:
            rows += 1
            rewards += mine
            solved += any(r >= threshold for r in mine)
    return EvalResult(
        policy,
        step,
        reward_mean=sum(rewards) / len(rewards) if rewards else None,
        pass_at_k=solved / rows if rows else None,
        k=k,
        rows=rows,
        failed=failed,
    )


class Evaluator:
    """The eval passes on `data.eval` (none without eval rows) and the cross-play passes
    (`evaluation.crossPlay`, coordinator/crossplay.py) of one job."""

    def __init__(
        self,
        spec: RLJobSpec,
        rows: list[dict[str, Any]],
        fleet: Fleet,
        cross_play: CrossPlayer | None = None,
    ) -> None:
        assert spec.evaluation is not None
        self.cfg, self.seed = spec.evaluation, spec.training.seed
        self.source = spec.data.eval if spec.data is not None else None
        self.rows = rows[: self.cfg.max_rows] if self.cfg.max_rows else rows
        self.fleet, self.policies = fleet, [p.name for p in spec.policies]
        self.cross_play = cross_play
        self.latest: dict[str, EvalResult] = {}
        self._passes: dict[int, asyncio.Task[dict[str, EvalResult]]] = {}

    def due(self, step: int, last: bool) -> bool:
        """Whether an eval pass on the rows is due at `step` (never without eval rows)."""
        return bool(self.rows) and (last or step % self.cfg.every_steps == 0)

    async def before_training(self) -> dict[str, EvalResult]:
        """The pass at step 0 (the initial weights), for every policy."""
        if 0 not in self._passes:
            self._passes[0] = asyncio.ensure_future(self._pass(0))
        return await asyncio.shield(self._passes[0])

    async def at_step(self, policy: str, step: int, last: bool) -> EvalResult | None:
        """The policy's result of the pass at `step` when one is due (None otherwise), once the
        cross-play passes this step of the policy plays are done too."""
        if self.cross_play is not None:
            await self.cross_play.at_step(policy, step, last)
        if not self.due(step, last):
            return None
        if step not in self._passes:
            self._passes[step] = asyncio.ensure_future(self._pass(step))
        results = await asyncio.shield(self._passes[step])
        return results.get(policy)

    async def _pass(self, step: int) -> dict[str, EvalResult]:
        per_row: list[list[dict[str, float] | str]] = []
        for start in range(0, len(self.rows), ROWS_PER_WAVE):
            wave = range(start, min(start + ROWS_PER_WAVE, len(self.rows)))
            per_row += await asyncio.gather(*(self._row(step, i) for i in wave))
        results = {p: summarize(p, step, self.cfg.k, per_row, self.cfg.pass_threshold) for p in self.policies}
        self.latest.update(results)
        for r in results.values():
            log.info(
                "eval.done",
                policy=r.policy,
                step=step,
                reward=r.reward_mean,
                pass_at_k=r.pass_at_k,
                k=r.k,
                rows=r.rows,
                failed=r.failed,
            )
        return results

    async def _row(self, step: int, index: int) -> list[dict[str, float] | str]:
        workers = [w for w in self.fleet.workers.values() if not w.dead and not w.draining]
        if not workers:
            return [f"eval row {index}: no workflow worker"] * self.cfg.k
        worker = workers[index % len(workers)]
        assert self.source is not None  # rows come from data.eval
        ref = RowRef(self.source, index, self.rows[index])
        seed = (self.seed * 1_000_003 + index) % 2**31  # the same draws at every pass: comparable
        try:
            out = await worker.actor.evaluate(f"eval{step}r{index}", seed, ref, self.cfg.k, self.cfg.greedy)
        except Exception as e:
            return [f"eval row {index}: {(str(e).splitlines() or [repr(e)])[0]}"] * self.cfg.k
        return out


def load_eval_rows(spec: RLJobSpec) -> list[dict[str, Any]] | None:
    """The eval rows when the job evaluates (None otherwise; none, [], for cross-play alone without
    data.eval); an unreadable file is a DataError naming `spec.data.eval` and the URI."""
    if spec.evaluation is None:
        return None
    if spec.data is None or spec.data.eval is None:
        return []
    try:
        return load_rows(spec.data.eval)
    except DataError as e:
        raise DataError(f"spec.data.eval: {e}") from e
