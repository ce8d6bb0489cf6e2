"""Built-in verifiable rewards, each 1.0 for a correct completion and 0.0 otherwise; the reference
answer is the row's `answer` field.

- `exact_match`: the completion, stripped (and a trailing period dropped), equals the answer.
- `numeric`: the last number in the completion is within `tolerance` of the answer (a number).
- `reasoning_gym`: for rows of `reasoning-gym://` data, the dataset's own `score_answer` (its
  scores may lie between 0 and 1).
- `math`: math-verify's parser and verifier (LaTeX, \\boxed{}, fractions, expressions), so
  `\\frac{1}{2}` matches `0.5`. It runs in a child process of its own (rewards/isolated.py): a
  call that takes more than MATH_TIMEOUT_S (sympy on a pathological expression) is ended with its
  process and fails the episode (reward_error), so it cannot stall a workflow worker's event loop
  longer than that. The child (and sympy, about a second of CPU) starts on the first `math`
  reward, not with this module: every job's driver and workflow workers import the built-ins.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import Any

from polyrl_runtime.rewards.isolated import IsolatedCall

ANSWER_FIELD = "answer"
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _answer(row: Mapping[str, Any]) -> Any:
    return row[ANSWER_FIELD]


def exact_match(completion: str, row: Mapping[str, Any]) -> float:
    def norm(s: str) -> str:
        return " ".join(s.strip().rstrip(".").split())

    return 1.0 if norm(completion) == norm(str(_answer(row))) else 0.0


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators allowed), or None."""
    for m in reversed(_NUMBER.findall(text)):
        try:
            return float(m.replace(",", ""))
        except ValueError:
            continue
    return None


def numeric_answer(completion: str, row: Mapping[str, Any], tolerance: float = 1e-6) -> float:
    got = last_number(completion)
    want = float(_answer(row)) if not isinstance(_answer(row), str) else last_number(_answer(row))
    if got is None or want is None:
        return 0.0
    return 1.0 if math.isclose(got, want, rel_tol=tolerance, abs_tol=tolerance) else 0.0


MATH_TIMEOUT_S = 10.0


def _math_verified(completion: str, gold_text: str) -> float:
    """math-verify's verdict; runs in `_MATH`'s child process, on its main thread, where
    math-verify's own SIGALRM timeouts work too."""
    from math_verify import parse, verify

    # A bare reference like `3` or `1/2` parses as an expression; wrapping it in $...$ lets the LaTeX
    # extractor read `\frac{1}{2}` too.
    gold = parse(gold_text if "$" in gold_text or "\\boxed" in gold_text else f"${gold_text}$")
    pred = parse(completion)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


_MATH = IsolatedCall(_math_verified, MATH_TIMEOUT_S, preload="math_verify")


def math_answer(completion: str, row: Mapping[str, Any]) -> float:
    return float(_MATH(completion, str(_answer(row))))


@functools.cache
def _gym_scorer(dataset: str) -> Any:
    import importlib
    import warnings

    try:
        with warnings.catch_warnings():  # some of its dependencies warn on import (SyntaxWarning)
            warnings.simplefilter("ignore")
            rg: Any = importlib.import_module("reasoning_gym")
    except ImportError as e:
        raise ImportError(
            "the reward reasoning_gym needs the reasoning-gym package: pip install 'polyrl-runtime[tasks]'"
        ) from e
    return rg.get_score_answer_fn(dataset)


def reasoning_gym_answer(completion: str, row: Mapping[str, Any]) -> float:
    """The score reasoning-gym's own dataset gives `completion` on the row's entry (rows of
    `reasoning-gym://` data: data/reasoning_gym.py). reasoning-gym is imported on first use."""
    meta = row["metadata"]
    entry = {"question": row["question"], "answer": row["answer"], "metadata": meta}
    return float(_gym_scorer(meta["source_dataset"])(completion, entry))


BUILTINS = {
    "exact_match": exact_match,
    "numeric": numeric_answer,
    "math": math_answer,
    "reasoning_gym": reasoning_gym_answer,
}
