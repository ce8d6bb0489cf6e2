"""Per-step records the driver emits (display, metrics files, /progress), a policy's running totals,
the reward window each step reports from, and the ends of the job's metrics series."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from polyrl_runtime.algorithms.step_metrics import zeros


@dataclass(frozen=True)
class Totals:
    """A policy's running totals that step records also give per step: samples the buffer dropped
    (by reason) and the job's failed episodes."""

    dropped: dict[str, int] = field(default_factory=dict)
    failed_episodes: int = 0

    def since(self, before: Totals) -> Totals:
        """What was added since `before` (an earlier reading of the same totals)."""
        return Totals(
            {k: v - before.dropped.get(k, 0) for k, v in self.dropped.items()},
            self.failed_episodes - before.failed_episodes,
        )


@dataclass
class StepRecord:
    """One optimizer step of one policy. Counters are this step's (since the policy's previous
    step) unless named `_total` (since the job started, across resumes): docs/local-run.md#metrics
    lists every column."""

    policy: str
    step: int
    version: int
    reward_mean: float | None
    success_mean: float | None
    episodes: int  # finished episodes of this policy reported since the previous step
    samples: int
    tokens: int
    loss: float
    staleness_mean: float
    staleness_max: int
    is_weight_mean: float
    is_truncated_frac: float
    clip_frac: float
    kl: float
    entropy: float
    grad_norm: float | None  # None: not finite (the step's last optimizer step was skipped)
    train_s: float
    sync_s: float
    elapsed_s: float
    samples_per_s: float
    # Optimizer steps of this step skipped for a non-finite loss or gradient (trainers/nonfinite.py).
    nonfinite_grad_steps: int = 0
    # Trained tokens a mask isCorrection (token-mask, sequence-mask) rejected: weight 0.
    is_masked_frac: float = 0.0
    # algorithm.critic: the critic's mean value loss over its optimizer steps, and the fraction of
    # trained tokens whose clipped value term was the larger.
    value_loss: float = 0.0
    value_clip_frac: float = 0.0
    # algorithm.distillation: the mean reverse KL to the teacher over trained tokens (log student -
    # log teacher of each sampled token, scored before the step's first update).
    distill_kl: float = 0.0
    # Samples of this policy the buffer dropped, by reason (experience.DropReason).
    dropped: dict[str, int] = field(default_factory=dict)
    dropped_total: dict[str, int] = field(default_factory=dict)
    # Episodes of the job that failed (any reason); several policies' rows count the same failures.
    failed_episodes: int = 0
    failed_episodes_total: int = 0
    # The eval pass at this step (coordinator/evaluation.py), when one ran: mean reward and pass@k.
    eval_reward_mean: float | None = None
    eval_pass_at_k: float | None = None
    # A trainer on a device pool (coordinator/pool_scheduler.py): the pool, how long this step's
    # turn held it and, of that, the seconds spent switching (sleep, wake, offload, restore); the
    # pool's holder changes so far and the fraction of its time it was busy.
    pool: str | None = None
    pool_resident_s: float | None = None
    pool_switch_s: float | None = None
    pool_switches_total: int | None = None
    pool_busy_fraction: float | None = None
    # Per other policy this one met in its episodes since the previous step: how many versions
    # apart they were (each policy's version in an episode: the oldest of its sampled tokens).
    version_skew_mean: dict[str, float] = field(default_factory=dict)
    version_skew_max: dict[str, int] = field(default_factory=dict)
    # A league policy (coordinator/league.py): the snapshot versions its engines hold, the bytes they
    # take on one engine, the current version's win rate against each held one (0.5 before any
    # game) and the games played against every snapshot so far (keys: versions as strings).
    league_held: list[int] | None = None
    league_bytes: int | None = None
    league_win_rate: dict[str, float] = field(default_factory=dict)
    league_games_total: dict[str, int] = field(default_factory=dict)
    # The policy's newest version that played a rated game (a league's episode against a snapshot, a
    # cross-play cell), and that version's rating (coordinator/ratings.py).
    rating: float | None = None
    rated_version: int | None = None

    @classmethod
    def before_training(
        cls,
        policy: str,
        version: int,
        elapsed_s: float,
        eval_reward_mean: float | None,
        eval_pass_at_k: float | None,
    ) -> StepRecord:
        """The row at step 0: the eval pass of the initial weights (`evaluation.beforeTraining`).
        No step ran, so its counters are 0 and its rewards None; only its eval columns are results."""
        return cls(
            policy=policy,
            step=0,
            version=version,
            reward_mean=None,
            success_mean=None,
            episodes=0,
            samples=0,
            tokens=0,
            staleness_mean=0.0,
            staleness_max=0,
            **zeros(),  # every loss metric (algorithms/step_metrics.py)
            grad_norm=0.0,
            train_s=0.0,
            sync_s=0.0,
            elapsed_s=elapsed_s,
            samples_per_s=0.0,
            eval_reward_mean=eval_reward_mean,
            eval_pass_at_k=eval_pass_at_k,
        )

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in sorted(d.pop("dropped").items()):
            d[f"dropped_{k}"] = v
        for k, v in sorted(d.pop("dropped_total").items()):
            d[f"dropped_{k}_total"] = v
        for name in ("version_skew_mean", "version_skew_max"):
            for k, v in sorted(d.pop(name).items()):
                d[f"{name}_{k}"] = v
        for name in ("league_win_rate", "league_games_total"):
            for k, v in sorted(d.pop(name).items(), key=lambda kv: int(kv[0])):
                d[f"{name}_v{k}"] = v
        return d


class RewardWindow:
    """Raw rewards of one policy's finished episodes since its last step (and a running total).

    Part of each checkpoint (`state`, `restore`): the episodes reported since the last step may have
    samples in the checkpoint's buffer, which the first step after a resume trains on, so that step
    reports their rewards, as the run that produced them would have."""

    def __init__(self, size: int) -> None:
        self.recent: deque[float] = deque(maxlen=size)
        self.success: deque[float] = deque(maxlen=size)
        self.since_step = 0
        # Since the last step, per other policy met in an episode: [episodes, summed skew, largest].
        self.skew: dict[str, list[int]] = {}

    def state(self) -> dict[str, Any]:
        return {
            "recent": list(self.recent),
            "success": list(self.success),
            "since_step": self.since_step,
            "skew": {k: list(v) for k, v in self.skew.items()},
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.recent.clear()
        self.recent.extend(float(x) for x in state.get("recent", []))
        self.success.clear()
        self.success.extend(float(x) for x in state.get("success", []))
        self.since_step = int(state.get("since_step", 0))
        self.skew = {str(k): [int(x) for x in v] for k, v in state.get("skew", {}).items()}

    def add(self, reward: float, success: float | None, skew: Mapping[str, int] | None = None) -> None:
        self.recent.append(reward)
        if success is not None:
            self.success.append(success)
        self.since_step += 1
        for other, apart in (skew or {}).items():
            acc = self.skew.setdefault(other, [0, 0, 0])
            acc[0] += 1
            acc[1] += apart
            acc[2] = max(acc[2], apart)

    def take_skew(self) -> dict[str, tuple[float, int]]:
        """Per other policy met since the last step: the mean and the largest version skew of the
        episodes they played together (and resets)."""
        out = {k: (total / n, hi) for k, (n, total, hi) in sorted(self.skew.items())}
        self.skew = {}
        return out

    def take(self) -> tuple[float | None, float | None, int]:
        n = self.since_step
        self.since_step = 0
        reward = sum(self.recent) / len(self.recent) if self.recent else None
        success = sum(self.success) / len(self.success) if self.success else None
        return reward, success, n


SERIES_KEYS = ("reward_mean", "success_mean")


@dataclass
class SeriesEnds:
    """Per policy, the first and the last value of each of `SERIES_KEYS` reported in the job's
    metrics series (steps without one skipped). A resumed run continues its checkpoint's series,
    so the first values stay those of the job's first run."""

    first: dict[str, dict[str, float]] = field(default_factory=dict)
    last: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, row: Mapping[str, Any]) -> None:
        policy = str(row["policy"])
        for key in SERIES_KEYS:
            value = row.get(key)
            if value is not None:
                self.first.setdefault(policy, {}).setdefault(key, float(value))
                self.last.setdefault(policy, {})[key] = float(value)

    def first_of(self, policy: str, key: str) -> float | None:
        return self.first.get(policy, {}).get(key)

    def last_of(self, policy: str, key: str) -> float | None:
        return self.last.get(policy, {}).get(key)
