"""Policy-gradient pieces shared by every trainer backend: advantages and the clipped, IS-corrected loss."""

from polyrl_runtime.algorithms.advantages import AdvantageStats, advantages
from polyrl_runtime.algorithms.losses import LossConfig, LossStats, policy_loss, sequence_logprobs

__all__ = [
    "AdvantageStats",
    "LossConfig",
    "LossStats",
    "advantages",
    "policy_loss",
    "sequence_logprobs",
]
