"""algorithm.isCorrection against its formulas on fixed tensors: the importance weight of the proximal
policy against the behaviour (engine) one, per token truncated at isCap (token-truncate), per sequence
as the product over its trained tokens truncated at isCap (sequence-truncate), masked outside
[1 / isCap, isCap] per token (token-mask) or per sequence (sequence-mask), or 1 (none)."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl_operator.api.algorithm import Algorithm
from polyrl_runtime.algorithms.losses import LossConfig, importance_weights, policy_loss

# log(pi_prox / mu) per token; row 0: 0.5 + 0.4 + (0.9, untrained) ; row 1: 1.0 + (-0.5).
D = torch.tensor([[0.5, 0.4, 0.9], [1.0, -0.5, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
BEHAV = torch.zeros(2, 3)
CAP = 2.0


def test_token_truncate_caps_each_token() -> None:
    w, over = importance_weights(D, BEHAV, MASK, "token-truncate", CAP)
    want = [min(math.exp(v), CAP) for row in D.tolist() for v in row]
    assert w.flatten().tolist() == pytest.approx(want, rel=1e-6)
    assert over.tolist() == [[False, False, True], [True, False, False]]


def test_sequence_truncate_is_the_capped_product_over_trained_tokens() -> None:
    w, over = importance_weights(D, BEHAV, MASK, "sequence-truncate", CAP)
    row0 = min(math.exp(0.5) * math.exp(0.4), CAP)  # the untrained 0.9 is not in the product
    row1 = min(math.exp(1.0) * math.exp(-0.5), CAP)
    assert w[0].tolist() == pytest.approx([row0] * 3, rel=1e-6)
    assert w[1].tolist() == pytest.approx([row1] * 3, rel=1e-6)
    assert row0 == CAP and over[0].all() and row1 < CAP and not over[1].any()


def test_a_long_sequence_product_stays_finite() -> None:
    d = torch.full((1, 4000), 0.5)  # exp(2000) overflows float32; the log-space product does not
    w, over = importance_weights(d, torch.zeros_like(d), torch.ones_like(d), "sequence-truncate", CAP)
    assert torch.isfinite(w).all() and float(w[0, 0]) == pytest.approx(CAP) and over.all()
    w, _ = importance_weights(-d, torch.zeros_like(d), torch.ones_like(d), "sequence-truncate", CAP)
    assert torch.isfinite(w).all() and float(w[0, 0]) >= 0.0


def test_token_mask_keeps_the_weight_inside_the_band_and_rejects_the_rest() -> None:
    d = torch.tensor([[0.5, -0.8, 0.9], [-0.6, 0.0, 0.7]])  # log 2 = 0.693: 0.9, -0.8, 0.7 are out
    w, out = importance_weights(d, BEHAV, torch.ones_like(d), "token-mask", CAP)
    want = [[math.exp(0.5), 0.0, 0.0], [math.exp(-0.6), 1.0, 0.0]]
    assert w.tolist() == [pytest.approx(row, rel=1e-6) for row in want]
    assert out.tolist() == [[False, True, True], [False, False, True]]


def test_sequence_mask_rejects_a_whole_row_whose_product_leaves_the_band() -> None:
    w, out = importance_weights(D, BEHAV, MASK, "sequence-mask", CAP)
    # row 0: exp(0.9) > 2 is rejected whole; row 1: exp(0.5) is kept on every token
    assert w[0].tolist() == [0.0] * 3 and out[0].all()
    assert w[1].tolist() == pytest.approx([math.exp(0.5)] * 3, rel=1e-6) and not out[1].any()
    low = torch.tensor([[-0.5, -0.4, 0.0]])  # product exp(-0.9) < 1 / 2: rejected as well
    w, out = importance_weights(low, torch.zeros(1, 3), torch.ones(1, 3), "sequence-mask", CAP)
    assert w.tolist() == [[0.0] * 3] and out.all()


def test_a_masked_token_adds_no_loss_and_no_gradient_and_is_counted() -> None:
    logp = D.clone().requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    cfg = LossConfig(is_correction="token-mask")
    loss, stats = policy_loss(logp, D, BEHAV, adv, MASK, cfg=cfg)
    loss.backward()
    assert logp.grad is not None
    # D's trained tokens: 0.5, 0.4 kept; 1.0 rejected (> log 2); -0.5 kept
    assert logp.grad[1, 0] == 0.0 and logp.grad[0, 0] != 0.0 and logp.grad[1, 1] != 0.0
    assert stats.is_masked_frac == pytest.approx(1 / 4) and stats.is_truncated_frac == 0.0
    _, truncating = policy_loss(D.clone(), D, BEHAV, adv, MASK, cfg=LossConfig())
    assert truncating.is_masked_frac == 0.0 and truncating.is_truncated_frac == pytest.approx(1 / 4)


def test_none_is_weight_one() -> None:
    w, over = importance_weights(D, BEHAV, MASK, "none", CAP)
    assert w.tolist() == [[1.0] * 3] * 2 and not over.any()


def test_the_weight_scales_the_loss_and_its_stats() -> None:
    logp = D.clone()  # ratio 1 against the proximal policy: each token's loss is -w * A
    adv = torch.tensor([1.0, 1.0])
    for mode in ("token-truncate", "sequence-truncate", "token-mask", "sequence-mask", "none"):
        w, over = importance_weights(D, BEHAV, MASK, mode, CAP)
        loss, stats = policy_loss(logp, D, BEHAV, adv, MASK, cfg=LossConfig(is_correction=mode))
        assert float(loss) == pytest.approx(-float((w * MASK).sum()), rel=1e-6), mode
        assert stats.is_weight_mean == pytest.approx(float((w * MASK).sum()) / 4, rel=1e-6), mode
        acted = stats.is_masked_frac if mode.endswith("mask") else stats.is_truncated_frac
        assert acted == pytest.approx(float((over.float() * MASK).sum()) / 4), mode


def test_an_unknown_correction_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="isCorrection"):
        importance_weights(D, BEHAV, MASK, "token-clip", CAP)


def test_the_api_field_reaches_the_loss_config() -> None:
    assert LossConfig.of(Algorithm(name="grpo")).is_correction == "token-truncate"
    algo = Algorithm.model_validate({"name": "grpo", "isCorrection": "sequence-truncate"})
    assert LossConfig.of(algo).is_correction == "sequence-truncate"
    with pytest.raises(ValueError, match=r"isCorrection|is_correction"):
        Algorithm.model_validate({"name": "grpo", "isCorrection": "clip"})
