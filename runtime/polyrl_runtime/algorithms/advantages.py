"""Advantages from per-sample learning signals, normalised per policy (Dr. MAS, MARS) or globally.

Input signals are what the samples carry (algorithms/estimators.py): for the grouped estimators
(grpo, dr_grpo, rloo, reinforce_pp_baseline) already group-relative (reward minus the group's
baseline for that agent), for reinforce_pp and ppo the raw reward. reinforce_pp_baseline's are then
treated as raw rewards are: centred and scaled by the batch's mean and std over every sample.

Group-relative signals are centred within their group, so they are not centred again; their scale is the root
mean square over the samples that carry a gradient (a non-zero signal). A group whose members all got
the same reward has none, and counting its zeros would shrink the scale as groups saturate: the few
groups still mixed would get advantages several times those of a batch where every group is mixed,
each step would move the policy as far whatever the evidence behind it, and a run nearly solved
would swing back (measured by benchmarks/stability.py). Scaled this way, an informative group
gets the same advantages however many others in the batch are informative, as with GRPO's per-group
standard deviation, while one scale per policy keeps every policy's advantages at unit scale
whatever its reward scale.

Modes (`algorithm.advantageNorm`):
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

from polyrl_runtime.algorithms.estimators import estimator

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
    def rms(self) -> float:
        """Root mean square about zero (the spread of signals that are centred already)."""
        return math.sqrt(max(0.0, self.total_sq / self.count)) if self.count else 0.0

    @property
    def std(self) -> float:
        if self.count < 2:
            return 0.0
        var = max(0.0, self.total_sq / self.count - self.mean**2)
        return math.sqrt(var * self.count / (self.count - 1))


def scale_stats(signals: torch.Tensor, algorithm: str = "grpo") -> AdvantageStats:
    """The statistics an advantage's scale comes from: for group-relative signals those that carry a
    gradient (non-zero), for raw rewards every signal."""
    return AdvantageStats.of(signals[signals != 0] if estimator(algorithm).centred else signals)


def agent_stats(
    signals: torch.Tensor, agents: Sequence[str], algorithm: str = "grpo"
) -> dict[str, AdvantageStats]:
    """`scale_stats` of each agent's signals (`agents[i]` is sample i's agent)."""
    out: dict[str, AdvantageStats] = {}
    for name in sorted(set(agents)):
        rows = torch.tensor([a == name for a in agents], dtype=torch.bool)
        out[name] = scale_stats(signals[rows], algorithm)
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
    """One advantage per sample. `stats` (`scale_stats`) cover the policy's whole step batch (all
    ranks); `per-agent` also needs each sample's agent and `by_agent`, every agent's statistics over
    all ranks."""
    grpo = estimator(algorithm).centred  # group-relative signals, centred by the worker
    if mode == "per-agent":
        if by_agent is None or len(agents) != len(signals):
            raise ValueError(
                "per-agent advantage normalisation needs each sample's agent and agent statistics"
            )
        if not len(signals):
            return signals
        if grpo:
            rms = torch.tensor([by_agent[a].rms for a in agents], dtype=signals.dtype)
            return signals / (rms + EPS)
        means = torch.tensor([by_agent[a].mean for a in agents], dtype=signals.dtype)
        stds = torch.tensor([by_agent[a].std for a in agents], dtype=signals.dtype)
        return (signals - means) / (stds + EPS)
    if mode == "none":
        return signals if grpo else signals - stats.mean
    if mode == "per-group":  # scaled by the worker, within each group (workflows/runner.py)
        return signals
    if grpo and mode == "per-policy":
        return signals / (stats.rms + EPS)
    centred = signals if grpo else signals - stats.mean
    if mode == "per-policy":
        return centred / (stats.std + EPS)
    if mode == "global":
        scale = stats.std if global_std is None else global_std
        return centred / (scale + EPS)
    raise ValueError(f"unknown advantage normalisation {mode!r}")
