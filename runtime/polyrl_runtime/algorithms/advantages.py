"""Advantages from per-sample learning signals, normalised per policy (Dr. MAS, MARS) or globally.

Input signals are what the samples carry: for GRPO already group-relative (reward minus the group's
mean for that agent), for PPO the raw reward. Modes (`algorithm.advantageNorm`):
  * `per-policy`: centre and scale by this policy's batch statistics: each agent's advantages have
    unit scale whatever its reward scale, so one agent's large rewards cannot drown another's;
  * `global`: centre per policy, scale by a standard deviation over all policies of the job;
  * `none`: GRPO signals as they are; PPO signals minus the batch mean (the baseline).
Statistics are sums so data-parallel ranks can all-reduce them before use.
"""

from __future__ import annotations

import math
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


def advantages(
    signals: torch.Tensor,
    mode: str,
    stats: AdvantageStats,
    *,
    algorithm: str = "grpo",
    global_std: float | None = None,
) -> torch.Tensor:
    """One advantage per sample. `stats` cover the policy's whole step batch (all ranks)."""
    if mode == "none":
        return signals - stats.mean if algorithm == "ppo" else signals
    centred = signals - stats.mean
    if mode == "per-policy":
        return centred / (stats.std + EPS)
    if mode == "global":
        scale = stats.std if global_std is None else global_std
        return centred / (scale + EPS)
    raise ValueError(f"unknown advantage normalisation {mode!r}")
