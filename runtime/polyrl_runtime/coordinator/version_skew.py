"""The job's bound on how far apart its policies' versions may be (spec.maxVersionSkew).

With `onVersionSkew: wait` a policy's trainer does not start a step that would take it more than
the bound ahead of the slowest policy still training: the stale-synchronous-parallel rule, applied
to whole policies. The slowest policy is never held back, so no policy waits forever on another
that waits too. A policy that finished, whose loop ended (its data ran out, the job stops) or whose
trainer is restarting or frozen (coordinator/policy_restart.py) holds no one back. With `onVersionSkew: drop` the buffer drops episodes over the bound instead
(experience/core.py) and this gate lets every step through."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from polyrl_operator.api import RLJobSpec
from polyrl_runtime.coordinator.job_state import PolicyRun

log = structlog.get_logger(__name__)

POLL_S = 0.02  # how often a held policy looks again (steps take far longer)


@dataclass(frozen=True)
class Laggard:
    """The slowest policy still training, which holds another back."""

    policy: str
    step: int


class SkewGate:
    """Holds each policy within `bound` versions of the slowest policy still training."""

    def __init__(self, runs: Mapping[str, PolicyRun], bound: int | None, total_steps: int) -> None:
        self.runs, self.bound, self.total = runs, bound, total_steps
        self._ended: set[str] = set()

    @classmethod
    def of(cls, spec: RLJobSpec, runs: Mapping[str, PolicyRun]) -> SkewGate:
        """The job's gate: bounded when the job sets maxVersionSkew and waits on it."""
        bound = spec.max_version_skew if spec.version_skew_action == "wait" else None
        return cls(runs, bound, spec.training.total_steps)

    def steps(self) -> dict[str, int]:
        """Every policy's step (for messages)."""
        return {n: r.step for n, r in self.runs.items()}

    def ended(self, policy: str) -> None:
        """The policy's training loop is over: it holds no one back any more."""
        self._ended.add(policy)

    def holding(self, policy: str) -> Laggard | None:
        """The policy that holds `policy` back from its next step, if one does."""
        if self.bound is None:
            return None
        training = [
            (r.step, n)
            for n, r in self.runs.items()
            if n != policy and n not in self._ended and r.step < self.total and r.trainer_state == "training"
        ]
        if not training:
            return None
        step, name = min(training)
        return Laggard(name, step) if self.runs[policy].step + 1 - step > self.bound else None

    async def wait(self, policy: str, stop: asyncio.Event) -> None:
        """Until `policy` may take its next step (or the job stops); says in the log whom it waits for."""
        laggard = self.holding(policy)
        if laggard is None:
            return
        log.info(
            "training.waits_for_version_skew",
            policy=policy,
            step=self.runs[policy].step,
            waits_for=laggard.policy,
            its_step=laggard.step,
            max_version_skew=self.bound,
        )
        while not stop.is_set() and self.holding(policy) is not None:
            await asyncio.sleep(POLL_S)
