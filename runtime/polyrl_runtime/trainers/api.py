"""What the driver calls on a policy's trainer ranks (Ray actors), whatever the backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class StepResult:
    """One rank's part of one training step (one optimizer step, or one per micro-batch under ppo)."""

    rank: int
    lease_id: int | None
    samples: int
    tokens: int
    loss: float
    clip_frac: float = 0.0
    is_weight_mean: float = 1.0
    is_truncated_frac: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0  # mean per-token entropy (computed only when algorithm.entropyCoef > 0)
    staleness_mean: float = 0.0
    staleness_max: int = 0
    signal_mean: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0  # the learning rate of every optimizer step of this training step
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class TrainerRank(Protocol):
    def address(self) -> tuple[str, int]: ...

    def setup(self, master_addr: str, master_port: int) -> None: ...

    def train_step(self, step: int, share: int, n_micro: int, global_std: float | None) -> StepResult: ...

    def save(self, directory: str, tag: str) -> None: ...

    def load(self, directory: str, tag: str) -> None: ...
