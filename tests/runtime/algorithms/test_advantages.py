"""Advantages: group-relative signals, per-policy and per-agent scales, PPO baseline."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl_runtime.algorithms.advantages import AdvantageStats, advantages, agent_stats, scale_stats
from polyrl_runtime.workflows.groups import group_relative


def test_group_relative_centres_each_grpo_agent_on_its_group_mean() -> None:
    rewards = [{"a": 1.0, "b": 10.0}, {"a": 0.0, "b": 20.0}, {"a": 0.0, "b": 30.0}]
    out = group_relative(rewards, {"a": 3})
    assert [r["a"] for r in out] == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert [r["b"] for r in out] == [10.0, 20.0, 30.0]  # b is not trained with GRPO: raw


def test_a_policy_with_a_smaller_group_size_compares_rewards_within_its_own_sub_groups() -> None:
    """A group is the largest groupSize (here a's 4); b's groupSize 2 makes its baselines over
    members 0-1 and 2-3. Member 2 failed: its sub-group's baseline is over the survivor alone."""
    rewards = [{"a": 1.0, "b": 1.0}, {"a": 0.0, "b": 0.0}, {"a": 0.0, "b": 4.0}]
    out = group_relative(rewards, {"a": 4, "b": 2}, members=[0, 1, 3])
    assert [r["a"] for r in out] == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert [r["b"] for r in out] == pytest.approx([0.5, -0.5, 0.0])


@settings(deadline=None)
@given(st.lists(st.floats(-100, 100), min_size=2, max_size=50), st.floats(0.01, 1000))
def test_ppo_per_policy_normalisation_is_scale_free(values: list[float], scale: float) -> None:
    # Dr. MAS: one agent's reward scale must not change its advantages (nor drown another's).
    x = torch.tensor(values, dtype=torch.float64)
    if x.std() * min(1.0, scale) < 1e-2:  # EPS in the denominator matters only below this
        return
    a = advantages(x, "per-policy", scale_stats(x, "ppo"), algorithm="ppo")
    b = advantages(x * scale, "per-policy", scale_stats(x * scale, "ppo"), algorithm="ppo")
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert float(a.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(a.std()) == pytest.approx(1.0, rel=1e-3)


@settings(deadline=None)
@given(
    st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=4, max_size=4), min_size=1, max_size=8),
    st.floats(0.01, 1000),
)
def test_grpo_per_policy_normalisation_is_scale_free(groups: list[list[float]], scale: float) -> None:
    signals = torch.tensor(
        [r["a"] for g in groups for r in group_relative([{"a": v} for v in g], {"a": len(g)})],
        dtype=torch.float64,
    )
    carrying_signals = signals[signals != 0]
    if not len(carrying_signals):  # no gradient anywhere
        return
    # EPS (1e-6) in the denominator changes a result by about EPS / RMS: within rtol only above this.
    if float(carrying_signals.square().mean().sqrt()) * min(1.0, scale) < 2e-2:
        return
    a = advantages(signals, "per-policy", scale_stats(signals))
    b = advantages(signals * scale, "per-policy", scale_stats(signals * scale))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    carrying = a[signals != 0]
    assert float(carrying.square().mean().sqrt()) == pytest.approx(1.0, rel=1e-3)
    assert (a[signals == 0] == 0).all()  # a saturated group stays without gradient


# A group with one success in eight, beside saturated groups (all right or all wrong): the mixed
# group's advantages must not grow as the others saturate, or a nearly solved run takes full-size
# steps on the evidence of one group.
MIXED = [1.0] + [0.0] * 7
SATURATED = {"every group mixed": [], "four saturated": [[1.0] * 8] * 2 + [[0.0] * 8] * 2}


@pytest.mark.parametrize("mode", ["per-policy", "per-agent"])
@pytest.mark.parametrize("others", SATURATED.values(), ids=SATURATED.keys())
def test_grpo_advantages_of_a_mixed_group_do_not_depend_on_saturated_groups(
    mode: str, others: list[list[float]]
) -> None:
    groups = [MIXED] * 4 + others
    signals = torch.tensor(
        [r["a"] for g in groups for r in group_relative([{"a": v} for v in g], {"a": len(g)})],
        dtype=torch.float64,
    )
    agents = ["a"] * len(signals)
    adv = advantages(
        signals, mode, scale_stats(signals), agents=agents, by_agent=agent_stats(signals, agents)
    )
    alone = advantages(signals[:32], "per-policy", scale_stats(signals[:32]))
    torch.testing.assert_close(adv[:32], alone)
    assert (adv[32:] == 0).all()
    # the one success of eight: +7/8 against a root mean square of sqrt(7/64)
    assert float(adv[0]) == pytest.approx((7 / 8) / math.sqrt(7 / 64), rel=1e-4)


def test_stats_merge_like_one_batch_across_ranks() -> None:
    x = torch.arange(10.0)
    merged = AdvantageStats.of(x[:3]).merged(AdvantageStats.of(x[3:]))
    whole = AdvantageStats.of(x)
    assert merged.mean == pytest.approx(whole.mean) and merged.std == pytest.approx(whole.std)
    assert whole.std == pytest.approx(float(x.std()))


def test_none_mode_keeps_grpo_signals_and_gives_ppo_a_baseline() -> None:
    x = torch.tensor([1.0, 2.0, 3.0])
    s = AdvantageStats.of(x)
    assert advantages(x, "none", s, algorithm="grpo").tolist() == [1.0, 2.0, 3.0]
    assert advantages(x, "none", s, algorithm="ppo").tolist() == [-1.0, 0.0, 1.0]
    # global: GRPO signals are centred in their groups already; PPO's are centred on the batch
    g = advantages(x, "global", s, global_std=2.0)
    assert g.tolist() == pytest.approx([0.5, 1.0, 1.5], abs=1e-5)
    g = advantages(x, "global", s, algorithm="ppo", global_std=2.0)
    assert g.tolist() == pytest.approx([-0.5, 0.0, 0.5], abs=1e-5)
    with pytest.raises(ValueError, match="unknown advantage normalisation"):
        advantages(x, "bogus", s)
    assert math.isfinite(AdvantageStats.of(torch.zeros(1)).std)
