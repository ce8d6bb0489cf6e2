"""The solver-verifier workflow: its judgement reward, its problems, and one episode on the real torch
engine (the solver's turn as text, the verifier's as a chat sequence)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.models import load_tokenizer
from polyrl_runtime.workflows.api import EpisodeContext
from polyrl_runtime.workflows.solver_verifier import Problem, SolverVerifier, judge_reward, shown_answer
from polyrl_testenv.inprocess import engine_routes


@pytest.mark.parametrize(
    ("verdict", "claimed", "answer", "reward"),
    [
        ("y", "3", 3, 1.0),  # right answer accepted
        ("n", "3", 3, 0.0),  # right answer rejected
        ("n", "2", 3, 1.0),  # wrong answer rejected
        ("y", "2", 3, 0.0),  # wrong answer accepted
        ("y", " 4 ", 4, 1.0),  # whitespace around the claim does not matter
        ("n", "", 0, 1.0),  # no answer is a wrong answer
    ],
)
def test_judge_reward(verdict: str, claimed: str, answer: int, reward: float) -> None:
    assert judge_reward(verdict, claimed, answer) == reward


@pytest.mark.parametrize(("a", "b"), [(0, 0), (1, 2), (4, 4)])
def test_problem(a: int, b: int) -> None:
    p = Problem(a, b)
    assert p.answer == a + b and p.sum == f"{a}+{b}="


DIGITS = [str(d) for d in range(5)]


@pytest.mark.parametrize(
    ("claimed", "contrast", "shown_kind"),
    [
        ("3", 0.0, "claimed"),  # contrast 0: always the solver's answer
        ("1", 0.0, "claimed"),
        ("3", 1.0, "wrong"),  # contrast 1, the solver right: a wrong digit
        ("1", 1.0, "right"),  # contrast 1, the solver wrong: the right answer
        ("", 1.0, "right"),  # no answer is a wrong answer
    ],
)
def test_shown_answer(claimed: str, contrast: float, shown_kind: str) -> None:
    for index in range(20):
        shown, contrasted = shown_answer(claimed, 3, DIGITS, contrast, seed=7, index=index)
        assert contrasted == (shown_kind != "claimed")
        if shown_kind == "claimed":
            assert shown == claimed
        elif shown_kind == "right":
            assert shown == "3"
        else:
            assert shown in DIGITS and shown != "3"


@pytest.mark.parametrize("claimed", ["3", "1"])
def test_at_contrast_one_half_the_verifier_judges_right_answers_half_the_time_whatever_the_solver(
    claimed: str,
) -> None:
    """The balance the workflow promises: a solver always right, or always wrong, gives the verifier
    right answers in about half the episodes, drawn per episode (members of one group differ)."""
    draws = [shown_answer(claimed, 3, DIGITS, 0.5, seed=s, index=i) for s in range(50) for i in range(8)]
    right = sum(shown == "3" for shown, _ in draws) / len(draws)
    assert 0.45 <= right <= 0.55, right
    one_group = {contrasted for _, contrasted in draws[:8]}
    assert one_group == {True, False}
    assert shown_answer(claimed, 3, DIGITS, 0.5, seed=4, index=2) == shown_answer(
        claimed, 3, DIGITS, 0.5, seed=4, index=2
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"max_operand": 5}, "max_operand must be in 1..4"),
        ({"max_operand": 0}, "max_operand must be in 1..4"),
        ({"contrast": 1.5}, "contrast must be in 0..1"),
        ({"contrast": -0.1}, "contrast must be in 0..1"),
        ({"solver": "a", "verifier": "a"}, "must be different agents"),
    ],
)
def test_bad_args(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SolverVerifier(**args)


class _Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self.fn(*args)


def test_an_episode_rewards_both_agents_consistently(tiny_qwen2_dir: Path) -> None:
    uri = f"file://{tiny_qwen2_dir}"
    handles = {
        p: {
            f"{p}-0": type(
                "H",
                (),
                {
                    "generate": _Method(
                        TorchEngine(f"{p}-0", p, uri, transport="shm", seed=1, dtype="float32").generate
                    )
                },
            )()
        }
        for p in ("solver", "verifier")
    }
    tok = load_tokenizer(uri)

    async def go() -> None:
        kinds: set[bool] = set()
        for seed in range(6):
            ctx = EpisodeContext(
                f"ep-{seed}",
                "g-1",
                seed,  # the episode's index: what draws its contrasting answer
                seed,
                EnginePool(engine_routes(handles)),
                {"solver": tok, "verifier": tok},
                {p: SamplingParams(temperature=1.0, max_new_tokens=4) for p in ("solver", "verifier")},
            )
            outcome = await SolverVerifier().run_episode(ctx)
            solver_turn, verifier_turn = ctx.turns
            assert (solver_turn.agent, verifier_turn.agent) == ("solver", "verifier")
            claimed = tok.decode(solver_turn.response_ids.tolist())
            verdict = tok.decode(verifier_turn.response_ids.tolist())
            assert claimed in "01234" and verdict in ("y", "n")
            rng_problem = random.Random(seed)  # the workflow draws its problem from the group seed
            a, b = rng_problem.randint(0, 2), rng_problem.randint(0, 2)
            shown, contrasted = shown_answer(claimed, a + b, DIGITS, 0.5, seed=seed, index=seed)
            prompt = tok.decode(verifier_turn.prompt_ids.tolist(), skip_special=False)
            assert f"<|im_start|>user\n{a}+{b}={shown}?<|im_end|>" in prompt
            assert outcome.rewards["solver"] == float(claimed == str(a + b))
            assert outcome.rewards["verifier"] == judge_reward(verdict, shown, a + b)
            assert outcome.metadata["verifier_shown_solver"] == float(not contrasted)
            kinds.add(contrasted)
        assert kinds == {True, False}  # both what the solver said and a contrasting answer were judged

    asyncio.run(go())
