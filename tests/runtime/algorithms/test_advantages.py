"""Advantages: group-relative signals, per-policy normalisation, PPO baseline."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl_runtime.algorithms.advantages import AdvantageStats, advantages
from polyrl_runtime.workflows.runner import group_relative


def test_group_relative_centres_each_grpo_agent_on_its_group_mean() -> None:
    rewards = [{"a": 1.0, "b": 10.0}, {"a": 0.0, "b": 20.0}, {"a": 0.0, "b": 30.0}]
    out = group_relative(rewards, {"a"})
    assert [r["a"] for r in out] == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert [r["b"] for r in out] == [10.0, 20.0, 30.0]  # b is not trained with GRPO: raw


@settings(deadline=None)
@given(st.lists(st.floats(-100, 100), min_size=2, max_size=50), st.floats(0.01, 1000))
def test_per_policy_normalisation_is_scale_free(values: list[float], scale: float) -> None:
    # Dr. MAS: one agent's reward scale must not change its advantages (nor drown another's).
    x = torch.tensor(values, dtype=torch.float64)
    if x.std() * min(1.0, scale) < 1e-2:  # EPS in the denominator matters only below this
        return
    a = advantages(x, "per-policy", AdvantageStats.of(x))
    b = advantages(x * scale, "per-policy", AdvantageStats.of(x * scale))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert float(a.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(a.std()) == pytest.approx(1.0, rel=1e-3)


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
    g = advantages(x, "global", s, global_std=2.0)
    assert g.tolist() == pytest.approx([-0.5, 0.0, 0.5], abs=1e-5)
    with pytest.raises(ValueError, match="unknown advantage normalisation"):
        advantages(x, "bogus", s)
    assert math.isfinite(AdvantageStats.of(torch.zeros(1)).std)
