"""A rank's report of one training step (`StepResult`): what it trained on, its loss and loss
statistics over every optimizer step it took, its samples' staleness and its gradient's state."""

from __future__ import annotations

import numpy as np

from polyrl_runtime.experience.batches import SampleBatch
from polyrl_runtime.experience.state import Lease
from polyrl_runtime.trainers.api import StepResult
from polyrl_runtime.trainers.critic import ValueReport
from polyrl_runtime.trainers.nonfinite import StepGuard
from polyrl_runtime.trainers.step_inputs import LossTotals, StepInputs


def step_result(
    inputs: StepInputs,
    lease: Lease | None,
    batch: SampleBatch | None,
    totals: LossTotals,
    version: int,
    *,
    rank: int,
    guard: StepGuard,
    updates: int,
    lr: float,
    wall_s: float,
    value: ValueReport | None = None,
) -> StepResult:
    """`updates`: the optimizer steps the step took (epochs x mini-batches); its loss is their mean.
    Staleness: how many versions each sample's oldest token lags the weights it was trained from."""
    samples, n = inputs.samples, 0 if batch is None else len(batch)
    lag = np.array([max(0, (version - 1) - s.min_version) for s in samples], dtype=np.float64)
    return StepResult(
        rank=rank,
        lease_id=lease.lease_id if lease is not None else None,
        samples=n,
        tokens=0 if batch is None else batch.trained_tokens,  # context tokens are not trained
        loss=totals.loss / updates,
        **totals.per_token(),  # the token-weighted loss metrics (algorithms/step_metrics.py)
        value_loss=value.loss if value is not None else 0.0,
        value_clip_frac=value.clip_frac if value is not None else 0.0,
        distill_kl=inputs.distill[0] / max(inputs.distill[1], 1),
        staleness_mean=float(lag.mean()) if len(lag) else 0.0,
        staleness_max=int(lag.max()) if len(lag) else 0,
        signal_mean=float(inputs.signals.mean()) if n else 0.0,
        grad_norm=guard.grad_norm(),
        # The critic's skips count too: a value model that cannot train corrupts every advantage.
        skipped_nonfinite=guard.skipped + (value.skipped if value is not None else 0),
        lr=lr,
        wall_s=wall_s,
    )
