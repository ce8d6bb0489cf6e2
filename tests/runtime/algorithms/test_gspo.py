"""GSPO's sequence-level ratio (`ratioLevel: sequence`) against its formula: each sequence's ratio
is the geometric mean of its trained tokens' ratios, clipped as a whole, and its gradient is
s * mean_t grad log pi (GSPO-token form) under seq-mean-token-mean."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl_operator.api.algorithm import Algorithm
from polyrl_runtime.algorithms.losses import LossConfig, policy_loss, probability_ratio

PROX = torch.zeros(2, 3)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the second row has two trained tokens
LOGP = torch.tensor([[0.3, -0.1, 0.4], [0.2, 0.6, 9.0]])  # 9.0 sits at padding: never counted


def test_the_sequence_ratio_is_the_geometric_mean_of_the_trained_tokens() -> None:
    ratio = probability_ratio(LOGP, PROX, MASK, "sequence")
    assert ratio[0].tolist() == pytest.approx([math.exp(0.2)] * 3)
    assert ratio[1, :2].tolist() == pytest.approx([math.exp(0.4)] * 2)
    assert torch.allclose(probability_ratio(LOGP, PROX, MASK, "token"), torch.exp(LOGP))


def test_its_gradient_is_gspos() -> None:
    """Unclipped, the per-sequence loss is -s_i A_i; its gradient in each trained token's logp is
    -s_i A_i / |y_i| (the sequence-level objective differentiated through s_i)."""
    adv = torch.tensor([1.0, -2.0])
    logp = LOGP.clone().requires_grad_(True)
    cfg = LossConfig(
        ratio_level="sequence", loss_aggregation="seq-mean-token-mean", clip_eps=10.0, is_cap=100.0
    )
    loss, _ = policy_loss(logp, PROX, PROX, adv, MASK, cfg=cfg)
    loss.backward()
    assert logp.grad is not None
    s = [math.exp(0.2), math.exp(0.4)]
    assert float(loss) == pytest.approx(-(s[0] * 1.0) - (s[1] * -2.0))
    assert logp.grad[0].tolist() == pytest.approx([-s[0] * 1.0 / 3] * 3)
    assert logp.grad[1].tolist() == pytest.approx([-s[1] * -2.0 / 2] * 2 + [0.0])


def test_the_whole_sequence_is_clipped_together() -> None:
    """With A > 0 and s above 1 + eps the sequence's tokens all lose their gradient, whatever each
    token's own ratio (token-level clipping would keep the second token of row 0)."""
    logp = LOGP.clone().requires_grad_(True)
    cfg = LossConfig(ratio_level="sequence", clip_eps=3e-4, clip_eps_high=4e-4)
    loss, stats = policy_loss(logp, PROX, PROX, torch.tensor([1.0, 1.0]), MASK, cfg=cfg)
    loss.backward()
    assert logp.grad is not None and float(logp.grad.abs().sum()) == 0.0
    assert stats.clip_frac == 1.0


def test_the_api_sets_it() -> None:
    algo = Algorithm.model_validate({"ratioLevel": "sequence", "clipEps": 3e-4, "clipEpsHigh": 4e-4})
    assert LossConfig.of(algo).ratio_level == "sequence"
    assert LossConfig.of(Algorithm()).ratio_level == "token"
