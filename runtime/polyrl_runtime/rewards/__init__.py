"""Reward functions: `fn(completion, row) -> float`, named by a built-in name (builtins.py) or an
import path `module:attr` (load.py). The row is the prompt data row (`ctx.sample`); built-ins compare
the completion against its `answer` field."""

from polyrl_runtime.rewards.builtins import BUILTINS, exact_match, math_answer, numeric_answer
from polyrl_runtime.rewards.load import (
    ImportPathError,
    RewardError,
    RewardFn,
    import_object,
    load_reward,
    score,
)

__all__ = [
    "BUILTINS",
    "ImportPathError",
    "RewardError",
    "RewardFn",
    "exact_match",
    "import_object",
    "load_reward",
    "math_answer",
    "numeric_answer",
    "score",
]
