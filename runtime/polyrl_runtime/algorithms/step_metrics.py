"""The loss metrics a training step reports, defined once: their names, whether a rank takes each
as a mean over its trained tokens (a `LossStats` statistic of the loss function) or computes it
itself, and how the policy's ranks combine theirs into the step's record.

Each name is also a field of the rank's `StepResult` (trainers/api.py) and of the driver's
`StepRecord` (coordinator/metrics/records.py), typed there, and a column of docs/local-run.md's
metrics table; tests/runtime/algorithms/test_step_metrics.py checks all three against this table,
and that neither result type carries a loss metric the table lacks. The trainer's totals
(trainers/step_inputs.py) and the driver's record (coordinator/training.py) are built from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class LossMetric:
    name: str
    # "mean": each rank's value is a mean over its own share (equal shares: the step's mean is the
    # ranks' mean); "sum": each rank's value is its share of the step's total (the loss, already
    # divided by the all-reduced denominator).
    over_ranks: Literal["mean", "sum"]
    # A mean over the rank's trained tokens of every pass, from the loss function's LossStats.
    per_token: bool


LOSS_METRICS: tuple[LossMetric, ...] = (
    LossMetric("loss", "sum", per_token=False),
    LossMetric("clip_frac", "mean", per_token=True),
    LossMetric("is_weight_mean", "mean", per_token=True),
    LossMetric("is_truncated_frac", "mean", per_token=True),
    LossMetric("is_masked_frac", "mean", per_token=True),
    LossMetric("kl", "mean", per_token=True),
    LossMetric("entropy", "mean", per_token=True),
    LossMetric("distill_kl", "mean", per_token=False),  # algorithm.distillation
    LossMetric("value_loss", "sum", per_token=False),  # algorithm.critic
    LossMetric("value_clip_frac", "mean", per_token=False),  # algorithm.critic
)
NAMES = tuple(m.name for m in LOSS_METRICS)
# The LossStats fields a rank averages over its trained tokens.
TOKEN_WEIGHTED = tuple(m.name for m in LOSS_METRICS if m.per_token)


# Both functions return keyword arguments of a result type, whose fields are typed there (Any: a
# float can meet each of them; the names are what the table defines).


def over_ranks(results: Sequence[object]) -> dict[str, Any]:
    """Every loss metric of a step from its ranks' results (objects with a field per name)."""
    world = max(len(results), 1)
    out: dict[str, Any] = {}
    for m in LOSS_METRICS:
        total = sum(float(getattr(r, m.name)) for r in results)
        out[m.name] = total if m.over_ranks == "sum" else total / world
    return out


def zeros() -> dict[str, Any]:
    """Every loss metric at 0 (a record of no training step)."""
    return dict.fromkeys(NAMES, 0.0)
