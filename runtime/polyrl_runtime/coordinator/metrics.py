"""Per-step records the driver emits (display, metrics files, /progress) and run-level counters."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StepRecord:
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
    grad_norm: float
    train_s: float
    sync_s: float
    elapsed_s: float
    samples_per_s: float
    dropped: dict[str, int] = field(default_factory=dict)
    failed_episodes: int = 0
    # The eval pass at this step (coordinator/evaluation.py), when one ran: mean reward and pass@k.
    eval_reward_mean: float | None = None
    eval_pass_at_k: float | None = None

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        dropped = d.pop("dropped")
        for k, v in sorted(dropped.items()):
            d[f"dropped_{k}"] = v
        return d


class RewardWindow:
    """Raw rewards of one policy's finished episodes since its last step (and a running total)."""

    def __init__(self, size: int) -> None:
        self.recent: deque[float] = deque(maxlen=size)
        self.success: deque[float] = deque(maxlen=size)
        self.since_step = 0

    def add(self, reward: float, success: float | None) -> None:
        self.recent.append(reward)
        if success is not None:
            self.success.append(success)
        self.since_step += 1

    def take(self) -> tuple[float | None, float | None, int]:
        n = self.since_step
        self.since_step = 0
        reward = sum(self.recent) / len(self.recent) if self.recent else None
        success = sum(self.success) / len(self.success) if self.success else None
        return reward, success, n
