"""Finding a reward function by name (a built-in) or import path `module:attr`, and calling it so
that a function that raises is reported naming the function and the episode."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from polyrl_runtime.rewards.builtins import BUILTINS

RewardFn = Callable[[str, Mapping[str, Any]], float]


class RewardError(RuntimeError):
    """A reward function could not be loaded, raised, or returned something that is not a number."""


@cache
def load_reward(name: str) -> RewardFn:
    """A built-in (`exact_match`, `numeric`, `math`) or `module:attr` (any callable taking the
    completion and the row)."""
    if name in BUILTINS:
        return BUILTINS[name]
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise RewardError(
            f"reward function {name!r}: neither a built-in ({', '.join(sorted(BUILTINS))}) nor 'module:attr'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"reward function {name!r}: cannot import it: {e}") from e
    if not callable(obj):
        raise RewardError(f"reward function {name!r}: {type(obj).__name__} is not callable")
    fn: RewardFn = obj
    return fn


def score(name: str, completion: str, row: Mapping[str, Any], *, episode: str) -> float:
    """`name`'s reward for `completion` on `row`, as a float; anything it raises becomes a
    RewardError naming the function and the episode."""
    fn = load_reward(name)
    try:
        value = fn(completion, row)
    except Exception as e:
        raise RewardError(
            f"episode {episode}: reward function {name!r} raised {type(e).__name__}: {e}"
        ) from e
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(
            f"episode {episode}: reward function {name!r} returned {type(value).__name__}, not a number"
        )
    return float(value)
