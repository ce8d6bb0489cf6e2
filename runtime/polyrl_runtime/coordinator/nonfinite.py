"""Training steps whose optimizer step was skipped for a non-finite gradient (trainers/nonfinite.py),
as the coordinator sees them: the step's metrics, and the policy's failure after
`algorithm.maxNonFiniteSteps` of them in a row.

A skipped step trains nothing but is otherwise a step (its version is published, its samples
acked). One now and then (a batch with an extreme importance weight) costs a step; every step
skipped means the policy cannot train (a learning rate that diverged, fp16 overflow, broken
rewards), and the job would otherwise run to its end with the initial weights. That is a failure
of the policy's trainer: raised from its training step, it takes the path of any other
(coordinator/policy_restart.py: restart from the latest checkpoint, freeze, or fail the job).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from polyrl_runtime.trainers.api import StepResult


class NonFiniteGradientError(RuntimeError):
    """A policy's last `maxNonFiniteSteps` training steps all skipped an optimizer step."""


def gradient_metrics(results: Sequence[StepResult]) -> dict[str, Any]:
    """The step record's gradient columns from the ranks' results (every rank decides the skips
    together, so their counts agree; the largest is taken all the same). `grad_norm` is rank 0's
    (the norm is global) and None when it is not finite: JSON has no NaN (a metrics.jsonl row
    stays strict JSON, `null`) and the sinks leave a missing value out."""
    norm = results[0].grad_norm
    return {
        "grad_norm": norm if math.isfinite(norm) else None,
        "nonfinite_grad_steps": max(r.skipped_nonfinite for r in results),
    }


class NonFiniteStreak:
    """Counts a policy's consecutive training steps that skipped at least one optimizer step for a
    non-finite gradient; a step that skipped none resets the count."""

    def __init__(self, policy: str, limit: int) -> None:
        self.policy, self.limit = policy, limit
        self.count = 0

    def check(self, step: int, results: Sequence[StepResult]) -> None:
        """Account for training step `step`; raise `NonFiniteGradientError` when it makes `limit`
        in a row (and start counting again: the failure restarts or stops the trainer)."""
        if not any(r.skipped_nonfinite for r in results):
            self.count = 0
            return
        self.count += 1
        if self.count < self.limit:
            return
        self.count = 0
        # The last optimizer step's norm: under ppo (one per micro-batch) that one may have been finite.
        norm = results[0].grad_norm
        last = f"step {step}" + ("" if math.isfinite(norm) else f", norm {norm}")
        raise NonFiniteGradientError(
            f"the gradient norm was not finite for {self.limit} training step"
            f"{'s' if self.limit != 1 else ''} in a row (last: {last}; "
            f"algorithm.maxNonFiniteSteps {self.limit}): its optimizer skipped them, so the policy "
            "does not train; check the rewards, the learning rate and the model's dtype"
        )
