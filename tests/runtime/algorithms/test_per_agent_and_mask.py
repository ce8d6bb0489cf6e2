"""Per-agent advantage normalisation (Dr. MAS) beside per-policy, and the loss mask: context tokens of
a conversation are input only, so nothing recorded or placed at them changes the loss or gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyrl_runtime.algorithms.advantages import (
    AdvantageStats,
    advantages,
    agent_stats,
    merge_agent_stats,
    scale_stats,
)
from polyrl_runtime.algorithms.losses import LossConfig, TokenBatch, policy_loss, sequence_logprobs
from polyrl_runtime.models.tiny import TinyCausalLM, TinyConfig

# Two agents of one policy, two GRPO groups' worth of group-relative signals each: the small-scale
# agent's rewards are ~1, the large-scale agent's ~100.
AGENTS = ("small", "small", "small", "small", "big", "big", "big", "big")
SIGNALS = torch.tensor([0.5, -0.5, 1.0, -1.0, 50.0, -50.0, 100.0, -100.0], dtype=torch.float64)


def _adv(mode: str) -> torch.Tensor:
    return advantages(
        SIGNALS, mode, scale_stats(SIGNALS), agents=AGENTS, by_agent=agent_stats(SIGNALS, AGENTS)
    )


@pytest.mark.parametrize(
    ("mode", "small_scale_at_least", "small_scale_at_most"),
    [
        ("per-policy", 0.0, 0.03),  # pooled with the big agent: its advantages all but vanish
        ("per-agent", 0.7, 1.5),  # its own statistics: unit scale, like the big agent
    ],
)
def test_per_agent_keeps_a_small_scale_agent_visible(
    mode: str, small_scale_at_least: float, small_scale_at_most: float
) -> None:
    adv = _adv(mode)
    small = adv[:4].abs().mean().item()
    assert small_scale_at_least <= small <= small_scale_at_most


def test_per_agent_gives_each_agent_unit_scale() -> None:
    adv = _adv("per-agent")
    for rows in (slice(0, 4), slice(4, 8)):
        assert float(adv[rows].mean()) == pytest.approx(0.0, abs=1e-9)
        assert float(adv[rows].square().mean().sqrt()) == pytest.approx(1.0, rel=1e-4)
    # Scaling one agent's rewards does not change anyone's advantages.
    scaled = SIGNALS * torch.tensor([1.0] * 4 + [7.0] * 4, dtype=torch.float64)
    again = advantages(
        scaled, "per-agent", scale_stats(scaled), agents=AGENTS, by_agent=agent_stats(scaled, AGENTS)
    )
    torch.testing.assert_close(again, adv)


def test_agent_stats_merge_across_ranks_like_one_batch() -> None:
    parts = [agent_stats(SIGNALS[:3], AGENTS[:3]), agent_stats(SIGNALS[3:], AGENTS[3:])]
    merged, whole = merge_agent_stats(parts), agent_stats(SIGNALS, AGENTS)
    assert merged.keys() == whole.keys()
    for name in whole:
        assert merged[name].mean == pytest.approx(whole[name].mean)
        assert merged[name].std == pytest.approx(whole[name].std)


def test_per_agent_without_agents_is_an_error() -> None:
    with pytest.raises(ValueError, match="per-agent advantage normalisation needs each sample's agent"):
        advantages(SIGNALS, "per-agent", AdvantageStats.of(SIGNALS))


def _loss_and_grad(
    model: TinyCausalLM, response: list[int], mask: list[bool], behav: list[float]
) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    tb = TokenBatch.build(
        [np.array([1, 2, 3], np.int32)],
        [np.array(response, np.int32)],
        [np.zeros(0, np.int32)],
        [np.array(mask)],
    )
    logp = sequence_logprobs(model, tb)
    loss, _ = policy_loss(
        logp,
        logp.detach() - 0.1,
        torch.tensor([behav]),
        torch.tensor([1.5]),
        tb.response_mask,
        cfg=LossConfig(kl_coef=0.0),
    )
    loss.backward()
    return float(loss), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_the_loss_ignores_masked_tokens() -> None:
    torch.manual_seed(0)
    model = TinyCausalLM(TinyConfig())
    mask = [True, True, False, False]
    # The context tokens at the end differ, and so does what is recorded at them.
    a = _loss_and_grad(model, [5, 6, 7, 8], mask, [-1.0, -2.0, 0.0, 0.0])
    b = _loss_and_grad(model, [5, 6, 11, 12], mask, [-1.0, -2.0, -9.0, -3.0])
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1], strict=True):
        assert torch.equal(x, y)
    # Unmasked, the same change does change the loss: the mask is what made them equal.
    c = _loss_and_grad(model, [5, 6, 7, 8], [True] * 4, [-1.0, -2.0, 0.0, 0.0])
    d = _loss_and_grad(model, [5, 6, 11, 12], [True] * 4, [-1.0, -2.0, -9.0, -3.0])
    assert c[0] != d[0]


def test_values_recorded_at_context_tokens_inside_a_conversation_do_not_count() -> None:
    torch.manual_seed(1)
    model = TinyCausalLM(TinyConfig())
    mask = [True, False, False, True]
    a = _loss_and_grad(model, [5, 6, 7, 8], mask, [-1.0, 0.0, 0.0, -2.0])
    b = _loss_and_grad(model, [5, 6, 7, 8], mask, [-1.0, -30.0, 4.0, -2.0])
    assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
