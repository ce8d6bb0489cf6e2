"""The clipped, importance-corrected loss, and logprobs that match the engine's exactly."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch

from polyrl_runtime.algorithms.losses import (
    LossConfig,
    TokenBatch,
    policy_loss,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)
from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.torch_engine import TorchEngine

CFG = LossConfig(clip_eps=0.2, is_cap=2.0, kl_coef=0.0)


def _one(
    logp: float, prox: float, behav: float, adv: float, cfg: LossConfig = CFG
) -> tuple[float, float, object]:
    lp = torch.tensor([[logp]], requires_grad=True)
    loss, stats = policy_loss(
        lp, torch.tensor([[prox]]), torch.tensor([[behav]]), torch.tensor([adv]), torch.ones(1, 1), cfg=cfg
    )
    loss.backward()
    assert lp.grad is not None
    return float(loss.detach()), float(lp.grad), stats


def test_on_policy_gradient_is_minus_advantage() -> None:
    loss, grad, stats = _one(-1.0, -1.0, -1.0, adv=2.0)
    assert loss == pytest.approx(-2.0) and grad == pytest.approx(-2.0)
    assert stats.is_weight_mean == pytest.approx(1.0) and stats.clip_frac == 0.0  # type: ignore[attr-defined]


def test_stale_sample_is_reweighted_and_the_weight_truncated() -> None:
    # behaviour policy gave the token half the probability the proximal policy gives it: w = 2
    _, grad, _ = _one(-1.0, -1.0, -1.0 - np.log(2.0), adv=1.0)
    assert grad == pytest.approx(-2.0, rel=1e-5)
    # ten times less likely under the behaviour policy: w = 10, truncated at is_cap = 2
    _, grad, stats = _one(-1.0, -1.0, -1.0 - np.log(10.0), adv=1.0)
    assert grad == pytest.approx(-2.0, rel=1e-5)
    assert stats.is_truncated_frac == 1.0  # type: ignore[attr-defined]


def test_ratio_outside_the_trust_region_stops_the_gradient() -> None:
    # pi_theta already 1.5x pi_prox and the advantage says "more": clipped, no gradient
    _, grad, stats = _one(np.log(1.5) - 1.0, -1.0, -1.0, adv=1.0)
    assert grad == 0.0 and stats.clip_frac == 1.0  # type: ignore[attr-defined]
    # ...but a negative advantage still pulls it back
    _, grad, _ = _one(np.log(1.5) - 1.0, -1.0, -1.0, adv=-1.0)
    assert grad > 0


def test_kl_penalty_is_zero_at_the_reference_and_positive_away() -> None:
    cfg = LossConfig(kl_coef=1.0)
    lp = torch.tensor([[-1.0, -2.0]])
    _, at_ref = policy_loss(lp, lp, lp, torch.zeros(1), torch.ones(1, 2), cfg=cfg, ref_logp=lp)
    _, away = policy_loss(lp, lp, lp, torch.zeros(1), torch.ones(1, 2), cfg=cfg, ref_logp=lp - 0.5)
    assert at_ref.kl == pytest.approx(0.0) and away.kl > 0


def test_padding_tokens_do_not_count() -> None:
    lp = torch.tensor([[-1.0, -5.0]], requires_grad=True)
    loss, stats = policy_loss(
        lp, lp.detach(), lp.detach(), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), cfg=CFG
    )
    loss.backward()
    assert lp.grad is not None and lp.grad[0, 1] == 0 and stats.tokens == 1


def test_trainer_logprobs_equal_the_engines_behaviour_logprobs() -> None:
    """On-policy means ratio 1: the trainer must reproduce the engine's logprob convention exactly
    (temperature, constrained decoding, padding), or every sample would look off-policy."""
    engine = TorchEngine("e", "p", "builtin://tiny", seed=5)
    tok_allowed = (20, 21, 22, 23)

    async def gen() -> list[tuple[list[int], object]]:
        prompts = [[1, 10, 11], [1, 12, 13, 14, 15], [1, 16]]
        params = [
            SamplingParams(temperature=0.7, max_new_tokens=4, allowed_ids=tok_allowed),
            SamplingParams(temperature=1.0, max_new_tokens=3),
            SamplingParams(temperature=1.3, max_new_tokens=5, allowed_ids=(30, 31)),
        ]
        outs = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params, strict=True)))
        return list(zip(prompts, outs, strict=True))

    results = asyncio.run(gen())
    for temp, (prompt, g), allowed in zip((0.7, 1.0, 1.3), results, (tok_allowed, (), (30, 31)), strict=True):
        tb = TokenBatch.build(
            [np.array(prompt, dtype=np.int32)],
            [g.token_ids],  # type: ignore[attr-defined]
            [np.array(allowed, dtype=np.int32)],
        )
        with torch.no_grad():
            lp = sequence_logprobs(engine.model, tb, temp)[0]
        np.testing.assert_allclose(lp.numpy(), g.logprobs, rtol=1e-4, atol=1e-5)  # type: ignore[attr-defined]
        if allowed:
            assert set(g.token_ids.tolist()) <= set(allowed)  # type: ignore[attr-defined]


def test_constrained_rows_of_different_lengths_give_finite_loss_and_gradients() -> None:
    # Regression: a short constrained row is padded with an id outside its allowed set (logprob -inf).
    from polyrl_runtime.models.tiny import build_tiny

    model = build_tiny("tiny", 64, seed=4)
    tb = TokenBatch.build(
        [np.array([1, 10], dtype=np.int32), np.array([1, 11, 12], dtype=np.int32)],
        [np.array([40], dtype=np.int32), np.array([40, 40, 40, 40], dtype=np.int32)],
        [np.array([40, 41], dtype=np.int32), np.array([40], dtype=np.int32)],
    )
    logp = sequence_logprobs(model, tb)
    assert torch.isfinite(logp).all() and logp[1].abs().max() == 0  # one allowed token: logprob 0
    loss, stats = policy_loss(
        logp, logp.detach(), logp.detach(), torch.tensor([1.0, -1.0]), tb.response_mask, cfg=CFG
    )
    loss.backward()
    assert torch.isfinite(loss) and stats.tokens == 5
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_entropy_is_over_the_allowed_ids_and_the_bonus_pushes_towards_uniform() -> None:
    from polyrl_runtime.models.tiny import build_tiny

    model = build_tiny("tiny", 64, seed=4)
    tb = TokenBatch.build(
        [np.array([1, 10], dtype=np.int32), np.array([1, 11, 12], dtype=np.int32)],
        [np.array([40, 41], dtype=np.int32), np.array([40], dtype=np.int32)],
        [np.array([40, 41, 42, 43], dtype=np.int32), np.array([40], dtype=np.int32)],
    )
    logp, entropy = sequence_logprobs_and_entropy(model, tb)
    assert torch.equal(logp, sequence_logprobs(model, tb))  # the same logprobs, one forward pass
    # four allowed ids: 0 < H <= ln 4; one allowed id: H = 0; padding: 0
    assert 0 < entropy[0, 0] <= np.log(4) + 1e-6 and 0 < entropy[0, 1] <= np.log(4) + 1e-6
    assert entropy[1].abs().max() == 0 and torch.isfinite(entropy).all()
    # with zero advantages only the bonus acts: a gradient step raises the entropy
    cfg = LossConfig(entropy_coef=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = float(entropy[0].sum().detach())
    loss, stats = policy_loss(
        logp, logp.detach(), logp.detach(), torch.zeros(2), tb.response_mask, cfg=cfg, entropy=entropy
    )
    assert stats.entropy == pytest.approx(float(entropy.sum().detach()) / 3, rel=1e-5)
    loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    opt.step()
    assert float(sequence_logprobs_and_entropy(model, tb)[1][0].sum().detach()) > before
    # off (coefficient 0): the entropy is reported but adds nothing to the loss
    off, _ = policy_loss(logp, logp, logp, torch.zeros(2), tb.response_mask, cfg=CFG, entropy=entropy)
    assert float(off.detach()) == 0.0


def test_each_row_is_scored_at_its_own_temperature() -> None:
    """Rows sampled at different temperatures (per-call ones) in one batch: each row's logprobs are the
    log-softmax of its logits / its own temperature, whatever temperature the call is given; the
    positions of both rows share chunks, so the per-position row index picks the temperature."""
    from polyrl_runtime.models.tiny import build_tiny

    model = build_tiny("tiny", 64, seed=4)
    prompts = [np.array([1, 10, 11], dtype=np.int32), np.array([1, 12], dtype=np.int32)]
    responses = [np.array([20, 21, 22, 23], dtype=np.int32), np.array([30, 31, 32], dtype=np.int32)]
    unconstrained = [np.zeros(0, np.int32)] * 2
    temps = (0.5, 2.0)
    tb = TokenBatch.build(prompts, responses, unconstrained, temperatures=temps)

    def by_hand(i: int, t: float) -> torch.Tensor:
        p, r = prompts[i], torch.from_numpy(responses[i].astype(np.int64))
        ids = torch.cat([torch.from_numpy(p.astype(np.int64)), r])[None]
        logits = model(ids, attention_mask=torch.ones_like(ids))[0].float()
        logp = torch.log_softmax(logits[len(p) - 1 : -1] / t, dim=-1)
        return logp.gather(1, r[:, None])[:, 0]

    with torch.no_grad():
        for chunk in (None, 3):  # one chunk; chunks of 3 positions spanning both rows
            logp = sequence_logprobs(model, tb, 1.0, chunk_tokens=chunk)
            for i, t in enumerate(temps):
                n = len(responses[i])
                torch.testing.assert_close(logp[i, :n], by_hand(i, t), rtol=1e-5, atol=1e-6)
                assert not torch.allclose(logp[i, :n], by_hand(i, 1.0))  # not the call's temperature
        uniform = sequence_logprobs(model, replace(tb, temperatures=None), 2.0)
    # With gradient (checkpointed chunks) and entropy: the same logprobs.
    lp, _ = sequence_logprobs_and_entropy(model, tb, 1.0, chunk_tokens=3)
    torch.testing.assert_close(lp.detach(), logp)
    # Every row at one temperature: what that temperature for the whole batch gives.
    same = TokenBatch.build(prompts, responses, unconstrained, temperatures=(2.0, 2.0))
    with torch.no_grad():
        torch.testing.assert_close(sequence_logprobs(model, same, 1.0), uniform)
    with pytest.raises(ValueError, match="1 temperatures for 2 rows"):
        TokenBatch.build(prompts, responses, unconstrained, temperatures=(1.0,))
