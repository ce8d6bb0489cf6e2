"""Finding a reward function by name (a built-in) or import path `module:attr`, and calling it so
that a function that raises is reported naming the function and the episode. `import_object` is the
one resolver of `module:attr` strings (rewards, workflow entrypoints, the start-up checks)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from polyrl_runtime.rewards.builtins import BUILTINS

RewardFn = Callable[[str, Mapping[str, Any]], float]


class RewardError(RuntimeError):
    """A reward function could not be loaded, raised, or returned something that is not a number."""


class ImportPathError(ImportError):
    """A `module:attr` string does not name an object that imports; the message says which part
    failed and the underlying error."""


def import_object(path: str) -> Any:
    """The object `module:attr` names (`attr` may be dotted: `Class.method`). Whatever importing the
    module raises (a missing package, a syntax error in it, an error at its top level) becomes an
    ImportPathError carrying the error's type and text."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ImportPathError(f"{path!r} is not of the form 'module:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:
        raise ImportPathError(f"cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportPathError(f"module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


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
        obj = import_object(name)
    except ImportPathError as e:
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
    if not math.isfinite(value):
        # A NaN or an infinity would make every advantage of its group, then of the policy's step, NaN.
        raise RewardError(
            f"episode {episode}: reward function {name!r} returned {value}, not a finite number"
        )
    return float(value)
