"""Advantages from per-sample learning signals, normalised per policy (Dr. MAS, MARS) or globally.

Input signals are what the samples carry: for GRPO already group-relative (reward minus the group's
mean for that agent), for PPO the raw reward. Modes (`algorithm.advantageNorm`):
  * `per-policy`: centre and scale by this policy's batch statistics: each agent's advantages have
    unit scale whatever its reward scale, so one agent's large rewards cannot drown another's;
  * `per-agent`: centre and scale each agent's samples by that agent's own statistics: when several
    agents share one policy (`workflow.args.policies`), `per-policy` pools their rewards, so an agent
    whose rewards are ~1 beside one whose rewards are ~100 gets near-zero advantages; per agent, both
    get unit scale (Dr. MAS's agent-wise normalisation);
  * `global`: centre per policy, scale by a standard deviation over all policies of the job;
  * `none`: GRPO signals as they are; PPO signals minus the batch mean (the baseline).
Statistics are sums so data-parallel ranks can all-reduce them before use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

EPS = 1e-6


@dataclass(frozen=True)
class AdvantageStats:
    count: float
    total: float
    total_sq: float

    @classmethod
    def of(cls, signals: torch.Tensor) -> AdvantageStats:
        s = signals.double()
        return cls(float(s.numel()), float(s.sum()), float((s * s).sum()))

    def merged(self, other: AdvantageStats) -> AdvantageStats:
        return AdvantageStats(
            self.count + other.count, self.total + other.total, self.total_sq + other.total_sq
        )

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        if self.count < 2:
            return 0.0
        var = max(0.0, self.total_sq / self.count - self.mean**2)
        return math.sqrt(var * self.count / (self.count - 1))


def agent_stats(signals: torch.Tensor, agents: Sequence[str]) -> dict[str, AdvantageStats]:
    """Statistics of each agent's signals (`agents[i]` is sample i's agent)."""
    out: dict[str, AdvantageStats] = {}
    for name in sorted(set(agents)):
        rows = torch.tensor([a == name for a in agents], dtype=torch.bool)
        out[name] = AdvantageStats.of(signals[rows])
    return out


def merge_agent_stats(parts: Sequence[Mapping[str, AdvantageStats]]) -> dict[str, AdvantageStats]:
    """Per-agent statistics of several ranks' shares combined."""
    out: dict[str, AdvantageStats] = {}
    for part in parts:
        for name, st in part.items():
            out[name] = out[name].merged(st) if name in out else st
    return out


def advantages(
    signals: torch.Tensor,
    mode: str,
    stats: AdvantageStats,
    *,
    algorithm: str = "grpo",
    global_std: float | None = None,
    agents: Sequence[str] = (),
    by_agent: Mapping[str, AdvantageStats] | None = None,
) -> torch.Tensor:
    """One advantage per sample. `stats` cover the policy's whole step batch (all ranks); `per-agent`
    also needs each sample's agent and `by_agent`, every agent's statistics over all ranks."""
    if mode == "per-agent":
        if by_agent is None or len(agents) != len(signals):
            raise ValueError(
                "per-agent advantage normalisation needs each sample's agent and agent statistics"
            )
        if not len(signals):
            return signals
        means = torch.tensor([by_agent[a].mean for a in agents], dtype=signals.dtype)
        stds = torch.tensor([by_agent[a].std for a in agents], dtype=signals.dtype)
        return (signals - means) / (stds + EPS)
    if mode == "none":
        return signals - stats.mean if algorithm == "ppo" else signals
    centred = signals - stats.mean
    if mode == "per-policy":
        return centred / (stats.std + EPS)
    if mode == "global":
        scale = stats.std if global_std is None else global_std
        return centred / (scale + EPS)
    raise ValueError(f"unknown advantage normalisation {mode!r}")
