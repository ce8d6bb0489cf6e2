"""algorithm.lossAggregation against its formulas on fixed tensors: token-mean (the step's token sum over
its token count), seq-mean-token-sum (each sequence's token sum, averaged over sequences) and
seq-mean-token-mean (each sequence's token mean, averaged over sequences), also when the step's rows are
split over micro-batches (the trainer divides the summed numerators by the step's all-reduced counts)."""

from __future__ import annotations

import pytest
import torch

from polyrl_operator.api.algorithm import Algorithm
from polyrl_runtime.algorithms.losses import (
    LossConfig,
    aggregate_numerator,
    aggregation_denominator,
    policy_loss,
)

# Three sequences of 3, 1 and 2 trained tokens (0 is padding or a context token).
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [5.0, 7.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
TOKEN_MEAN = (1 + 2 + 3 + 4 + 5 + 9) / 6
SEQ_TOKEN_SUM = (6 + 4 + 14) / 3
SEQ_TOKEN_MEAN = (2 + 4 + 7) / 3
WANT = {"token-mean": TOKEN_MEAN, "seq-mean-token-sum": SEQ_TOKEN_SUM, "seq-mean-token-mean": SEQ_TOKEN_MEAN}


def _step_loss(mode: str, micro: list[list[int]]) -> float:
    """The trainer's arithmetic: numerators summed over micro-batches, over the step's counts."""
    num = sum(float(aggregate_numerator(PER_TOKEN[rows], MASK[rows], mode)) for rows in micro)
    return num / aggregation_denominator(mode, float(MASK.sum()), float(len(PER_TOKEN)))


@pytest.mark.parametrize("mode", sorted(WANT))
def test_each_aggregation_is_its_formula(mode: str) -> None:
    assert _step_loss(mode, [[0, 1, 2]]) == pytest.approx(WANT[mode])


@pytest.mark.parametrize("mode", sorted(WANT))
def test_micro_batches_do_not_change_the_step_loss(mode: str) -> None:
    assert _step_loss(mode, [[0], [1, 2]]) == pytest.approx(WANT[mode])
    assert _step_loss(mode, [[2], [0], [1]]) == pytest.approx(WANT[mode])


def test_the_modes_differ_on_sequences_of_unequal_length() -> None:
    assert len({round(v, 6) for v in WANT.values()}) == 3


def test_a_row_without_trained_tokens_adds_nothing() -> None:
    mask = MASK.clone()
    mask[1] = 0
    got = float(aggregate_numerator(PER_TOKEN, mask, "seq-mean-token-mean"))
    assert got == pytest.approx(2 + 7)


def test_policy_loss_returns_the_numerator_of_its_aggregation() -> None:
    # ratio 1, weight 1: each token's loss is -advantage, so the per-token loss is -adv per row.
    logp = torch.zeros(3, 3)
    adv = torch.tensor([1.0, -2.0, 3.0])
    for mode, want in (("token-mean", -(3 * 1 - 2 * 1 + 3 * 2)), ("seq-mean-token-mean", -(1 - 2 + 3))):
        loss, stats = policy_loss(logp, logp, logp, adv, MASK, cfg=LossConfig(loss_aggregation=mode))
        assert float(loss) == pytest.approx(want)
        assert stats.tokens == 6  # stats stay per token


def test_an_unknown_aggregation_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="lossAggregation"):
        aggregate_numerator(PER_TOKEN, MASK, "seq-sum")
    with pytest.raises(ValueError, match="lossAggregation"):
        aggregation_denominator("seq-sum", 1.0, 1.0)


def test_the_api_field_reaches_the_loss_config() -> None:
    assert LossConfig.of(Algorithm(name="grpo")).loss_aggregation == "token-mean"
    algo = Algorithm.model_validate({"name": "grpo", "lossAggregation": "seq-mean-token-mean"})
    assert LossConfig.of(algo).loss_aggregation == "seq-mean-token-mean"
    with pytest.raises(ValueError, match=r"lossAggregation|loss_aggregation"):
        Algorithm.model_validate({"name": "grpo", "lossAggregation": "mean"})
