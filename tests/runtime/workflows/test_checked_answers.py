"""The data-driven solver-verifier workflow: what the verifier is shown, how both are rewarded, its
turns (two chat sequences, the verifier's one constrained token), and the arguments it refuses."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeEngine

from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.models import load_tokenizer
from polyrl_runtime.rewards.load import RewardError
from polyrl_runtime.workflows.api import EpisodeContext, Outcome
from polyrl_runtime.workflows.checked_answers import CheckedAnswers, verifier_message, wrong_near
from polyrl_testenv.inprocess import engine_routes

ROW = {"prompt": "What is 1 + 2?", "answer": "3"}
ARGS: dict[str, Any] = {"reward": "numeric", "extract": "last_number", "verdicts": ["y", "n"]}


def _episode(
    tok_dir: Path, solver_says: str, verdict: str, workflow: CheckedAnswers, *, index: int = 0, row: Any = ROW
) -> tuple[Outcome, EpisodeContext, list[str]]:
    uri = f"file://{tok_dir}"
    tok = load_tokenizer(uri)
    prompts: list[str] = []

    def solver(prompt: list[int], params: SamplingParams) -> list[int]:
        return [*tok.encode(solver_says, bos=False), *tok.stop_ids[:1]]

    def verifier(prompt: list[int], params: SamplingParams) -> list[int]:
        prompts.append(tok.decode(prompt))
        return [tok.token_id(verdict)]

    routes = engine_routes({"solver": {"s0": FakeEngine(solver)}, "verifier": {"v0": FakeEngine(verifier)}})

    async def go() -> tuple[Outcome, EpisodeContext]:
        ctx = EpisodeContext(
            f"ep-{index}",
            "g-1",
            index,
            7,
            EnginePool(routes),
            {"solver": tok, "verifier": tok},
            {p: SamplingParams(temperature=1.0, max_new_tokens=8) for p in ("solver", "verifier")},
            sample=row,
        )
        return await workflow.run_episode(ctx), ctx

    outcome, ctx = asyncio.run(go())
    return outcome, ctx, prompts


@pytest.mark.parametrize(
    "case",
    [
        ("1 + 2 = 3", "3", "y", 1.0, 1.0),  # a right answer accepted
        ("1 + 2 = 3", "3", "n", 1.0, 0.0),  # a right answer rejected
        ("1 + 2 = 4", "4", "n", 0.0, 1.0),  # a wrong answer rejected
        ("1 + 2 = 4", "4", "y", 0.0, 0.0),  # a wrong answer accepted
        ("I do not know", "", "n", 0.0, 1.0),  # no number is a wrong answer
    ],
)
def test_without_contrast_the_verifier_judges_the_solvers_answer(
    tiny_qwen2_dir: Path, case: tuple[str, str, str, float, float]
) -> None:
    solver_says, claimed, verdict, solver_reward, verifier_reward = case
    outcome, ctx, [prompt] = _episode(
        tiny_qwen2_dir, solver_says, verdict, CheckedAnswers(**ARGS, contrast=0.0)
    )
    assert outcome.rewards == {"solver": solver_reward, "verifier": verifier_reward}
    assert outcome.metadata["verifier_shown_solver"] == 1.0
    assert verifier_message(ROW["prompt"], claimed, ("y", "n")) in prompt
    solver_turn, verifier_turn = ctx.turns
    assert (solver_turn.agent, verifier_turn.agent) == ("solver", "verifier")
    # Trained on what was sampled: the verifier's one token, under its constraint to the verdicts.
    assert verifier_turn.response_ids.tolist() == [
        load_tokenizer(f"file://{tiny_qwen2_dir}").token_id(verdict)
    ]
    assert len(verifier_turn.allowed_ids) == 2


@pytest.mark.parametrize(
    ("solver_says", "shown_right"),
    [("1 + 2 = 3", False), ("1 + 2 = 5", True)],  # the other kind: a wrong number, or the answer
)
def test_a_contrasting_answer_is_of_the_other_kind(
    tiny_qwen2_dir: Path, solver_says: str, shown_right: bool
) -> None:
    for index in range(4):
        outcome, _, [prompt] = _episode(
            tiny_qwen2_dir, solver_says, "y", CheckedAnswers(**ARGS, contrast=1.0), index=index
        )
        assert outcome.metadata["verifier_shown_solver"] == 0.0
        shown = prompt.split("Proposed answer: ")[1].split("\n")[0]
        assert (shown == "3") == shown_right and shown != solver_says.rsplit(maxsplit=1)[-1]
        assert outcome.rewards["verifier"] == float(shown_right)  # "y" is right only for the answer


def test_wrong_near_is_a_near_wrong_number_and_refuses_text() -> None:
    import random

    rng = random.Random(0)
    assert {wrong_near("7", rng, episode="e") for _ in range(50)} == {"5", "6", "8", "9"}
    assert wrong_near(2.5, rng, episode="e") in {"0.5", "1.5", "3.5", "4.5"}
    with pytest.raises(ValueError, match=r"episode e-9: .*numeric answers only.*'blue'.*contrast to 0"):
        wrong_near("blue", rng, episode="e-9")


def test_a_text_answer_fails_the_episode_only_when_contrasted(tiny_qwen2_dir: Path) -> None:
    row = {"prompt": "Which colour?", "answer": "blue"}
    args = {**ARGS, "reward": "exact_match", "extract": "reply"}
    outcome, _, _ = _episode(tiny_qwen2_dir, "blue", "y", CheckedAnswers(**args, contrast=0.0), row=row)
    assert outcome.rewards == {"solver": 1.0, "verifier": 1.0}
    with pytest.raises(ValueError, match="episode ep-0: CheckedAnswers contrasts numeric answers only"):
        _episode(tiny_qwen2_dir, "blue", "y", CheckedAnswers(**args, contrast=1.0), row=row)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"extract": "tag"}, r"workflow.args.extract 'tag': expected one of reply, answer_tag"),
        ({"contrast": 1.5}, "workflow.args.contrast must be in 0..1"),
        ({"solver": "a", "verifier": "a"}, "must be different agents, both are 'a'"),
        ({"verdicts": ["yes"]}, r"verdicts must be two different words .* got \['yes'\]"),
        ({"verdicts": ["y", "y"]}, "verdicts must be two different words"),
        ({"reward": "no_such_reward"}, "no_such_reward"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(args: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, RewardError), match=message):
        CheckedAnswers(**args)


def test_without_data_the_episode_says_so(tiny_qwen2_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"plays rows of spec\.data\.train"):
        _episode(tiny_qwen2_dir, "3", "y", CheckedAnswers(**ARGS), row=None)
