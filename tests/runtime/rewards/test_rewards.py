"""Reward functions: the built-ins on known cases, a custom one by import path, and the errors."""

from __future__ import annotations

from typing import Any

import pytest

from polyrl_runtime.rewards import RewardError, load_reward, score
from polyrl_runtime.rewards.builtins import last_number


def constant_half(completion: str, row: Any) -> float:
    return 0.5


def raises(completion: str, row: Any) -> float:
    raise ZeroDivisionError("boom")


def not_a_number(completion: str, row: Any) -> str:
    return "yes"


def nan(completion: str, row: Any) -> float:
    return float("nan")


def infinite(completion: str, row: Any) -> float:
    return float("-inf")


@pytest.mark.parametrize(
    ("name", "completion", "answer", "expected"),
    [
        ("exact_match", "Paris", "Paris", 1.0),
        ("exact_match", "  Paris. ", "Paris", 1.0),
        ("exact_match", "paris", "Paris", 0.0),
        ("exact_match", "", "Paris", 0.0),
        ("numeric", "so the total is 42", 42, 1.0),
        ("numeric", "3 apples and 4 pears: 7", "7", 1.0),
        ("numeric", "it costs 1,250 dollars", 1250, 1.0),
        ("numeric", "about 0.3333333", 1 / 3, 1.0),
        ("numeric", "about 0.33", 1 / 3, 0.0),
        ("numeric", "-2.5", -2.5, 1.0),
        ("numeric", "no number at all", 3, 0.0),
        ("numeric", "41", 42, 0.0),
        ("math", "$\\frac{1}{2}$", "0.5", 1.0),
        ("math", "0.5", "\\frac{1}{2}", 1.0),
        ("math", "The answer is \\boxed{3}.", "3", 1.0),
        ("math", "The answer is \\boxed{4}.", "3", 0.0),
        ("math", "$x^2 + 2x + 1$", "(x+1)^2", 1.0),
        ("math", "I do not know", "3", 0.0),
        ("math", "", "3", 0.0),
    ],
)
def test_builtin_rewards(name: str, completion: str, answer: Any, expected: float) -> None:
    assert score(name, completion, {"answer": answer}, episode="g0-0") == expected


@pytest.mark.parametrize(
    ("text", "expected"), [("a 1 b 2.5", 2.5), ("x=-3", -3.0), ("1e3 items", 1000.0), ("none", None)]
)
def test_last_number(text: str, expected: float | None) -> None:
    assert last_number(text) == expected


def test_custom_reward_by_import_path() -> None:
    name = f"{__name__}:constant_half"
    assert score(name, "anything", {}, episode="g0-0") == 0.5


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", "neither a built-in"),
        ("no_such_module_xyz:f", "cannot import it"),
        (f"{__name__}:missing", "cannot import it"),
    ],
)
def test_bad_reward_names(name: str, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        load_reward(name)


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("raises", r"episode g3-1: reward function '.*:raises' raised ZeroDivisionError: boom"),
        ("not_a_number", r"episode g3-1: reward function '.*:not_a_number' returned str, not a number"),
        ("nan", r"episode g3-1: reward function '.*:nan' returned nan, not a finite number"),
        ("infinite", r"episode g3-1: reward function '.*:infinite' returned -inf, not a finite number"),
    ],
)
def test_reward_errors_name_function_and_episode(attr: str, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        score(f"{__name__}:{attr}", "x", {"answer": 1}, episode="g3-1")


def test_builtin_without_answer_field_is_a_reward_error() -> None:
    with pytest.raises(RewardError, match="reward function 'exact_match' raised KeyError"):
        score("exact_match", "x", {"question": "q"}, episode="g0-0")
