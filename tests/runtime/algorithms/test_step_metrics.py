"""The loss metrics' one definition (algorithms/step_metrics.py) against the types that carry them
and the docs that name them: a metric added to a result type but not to the table, or to the table
but not to the docs, fails here."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from polyrl_runtime.algorithms.losses import LossStats
from polyrl_runtime.algorithms.step_metrics import LOSS_METRICS, NAMES, TOKEN_WEIGHTED, over_ranks, zeros
from polyrl_runtime.coordinator.metrics.records import StepRecord
from polyrl_runtime.trainers.api import StepResult

DOCS = Path(__file__).resolve().parents[3] / "docs" / "local-run.md"

# StepResult fields that are not loss metrics: what a rank trained on, its samples' staleness and
# signals, its gradient's state and its timing.
NOT_LOSS = {
    "rank", "lease_id", "samples", "tokens", "staleness_mean", "staleness_max", "signal_mean",
    "grad_norm", "skipped_nonfinite", "lr", "wall_s", "extra",
}  # fmt: skip


def test_every_loss_metric_is_a_field_of_both_result_types_and_no_other_is() -> None:
    result = {f.name for f in fields(StepResult)}
    assert result - NOT_LOSS == set(NAMES), "a StepResult field that is neither in NOT_LOSS nor the table"
    assert set(NAMES) <= {f.name for f in fields(StepRecord)}
    assert set(TOKEN_WEIGHTED) == {f.name for f in fields(LossStats)} - {"tokens"}
    assert len(set(NAMES)) == len(NAMES)


def test_every_loss_metric_is_a_column_of_the_documented_metrics_table() -> None:
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith("| `")]
    columns = {name for line in rows for name in re.findall(r"`([a-z_]+)`", line.split("|")[1])}
    assert set(NAMES) <= columns, sorted(set(NAMES) - columns)


def test_ranks_combine_as_the_table_says() -> None:
    a = StepResult(rank=0, lease_id=None, samples=2, tokens=8, loss=0.25, kl=0.1, value_loss=1.0)
    b = StepResult(rank=1, lease_id=None, samples=2, tokens=8, loss=0.5, kl=0.3, value_loss=2.0)
    combined = over_ranks([a, b])
    for m in LOSS_METRICS:
        x, y = getattr(a, m.name), getattr(b, m.name)
        assert combined[m.name] == pytest.approx(x + y if m.over_ranks == "sum" else (x + y) / 2), m
    assert combined["loss"] == pytest.approx(0.75) and combined["kl"] == pytest.approx(0.2)
    assert combined["is_weight_mean"] == pytest.approx(1.0)  # StepResult's default


def test_a_record_before_training_has_every_loss_metric_at_zero() -> None:
    rec = StepRecord.before_training("p", 0, 1.0, None, None)
    assert {n: getattr(rec, n) for n in NAMES} == zeros()
