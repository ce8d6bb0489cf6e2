"""LLM-as-judge rewards (workflows/judge.py) on fake engines: the judge's message, its verdict read
from a constrained or a free reply, a reply without a verdict failing the episode as judge_error,
and bad arguments refused by name."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes import FakeBuffer, FakeEngine

from polyrl_operator.api import RLJob
from polyrl_runtime.data.row import RowRef
from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.experience.types import Ticket
from polyrl_runtime.models import CharTokenizer
from polyrl_runtime.workflows.judge import Judge, JudgeError
from polyrl_runtime.workflows.prompts import PromptCompletion
from polyrl_runtime.workflows.runner import WorkflowWorker
from polyrl_testenv.inprocess import engine_routes

TOK = CharTokenizer()


def solver_echo(prompt: list[int], params: SamplingParams) -> list[int]:
    """Answers `K+0=` with K."""
    return [TOK.token_id(TOK.decode(prompt).split("+")[0][-1])]


def judge_by_parity(prompt: list[int], params: SamplingParams) -> list[int]:
    """Says y to an even proposed answer, n to an odd one."""
    answer = TOK.decode(prompt).split("proposed answer: ")[1][0]  # the char tokenizer lowercases
    return [TOK.token_id("y" if int(answer) % 2 == 0 else "n")]


def judge_rambles(prompt: list[int], params: SamplingParams) -> list[int]:
    return [TOK.token_id(c) for c in "hmm"]


def _worker(judge_fn: Any, judge: dict[str, Any], buffer: FakeBuffer) -> WorkflowWorker:
    doc = {
        "apiVersion": "polyrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "t"},
        "spec": {
            "training": {"totalSteps": 1},
            "workflow": {
                "entrypoint": "polyrl_runtime.workflows.prompts:PromptCompletion",
                "args": {
                    "agent": "solver",
                    "judge": judge,
                    "policies": {"solver": "solver", "judge": "judge"},
                },
            },
            "policies": [
                {
                    "name": "solver",
                    "model": {"uri": "builtin://tiny"},
                    "algorithm": {"groupSize": 2},
                    "rollout": {"engine": "torch", "gpus": 0},
                },
                {
                    "name": "judge",
                    "frozen": True,
                    "model": {"uri": "builtin://tiny"},
                    "rollout": {"engine": "torch", "gpus": 0},
                },
            ],
        },
    }
    job = RLJob.model_validate(doc).model_dump_json(by_alias=True)
    routes = {"solver": {"s": FakeEngine(solver_echo)}, "judge": {"j": FakeEngine(judge_fn)}}
    return WorkflowWorker("w", job, BufferClient(buffer), engine_routes(routes))


def _play(judge_fn: Any, judge: dict[str, Any], prompt: str) -> tuple[Any, FakeBuffer]:
    buffer = FakeBuffer()
    worker = _worker(judge_fn, judge, buffer)
    tickets = [Ticket(i, frozenset({"solver", "judge"})) for i in range(2)]
    row = RowRef("file:///rows.jsonl", 0, {"prompt": prompt, "answer": "0"})
    report = asyncio.run(worker.run_group("g", 1, tickets, row))
    return report, buffer


VERDICTS = {"agent": "judge", "chat": False, "verdicts": {"y": 1.0, "n": 0.0}}


def test_the_judges_verdict_is_the_solvers_reward() -> None:
    report, buffer = _play(judge_by_parity, VERDICTS, "4+0=")
    assert all(e.ok for e in report.episodes)
    assert [e.metadata["rewards"] for e in buffer.episodes] == [{"solver": 1.0, "judge": 0.0}] * 2
    report, buffer = _play(judge_by_parity, VERDICTS, "3+0=")
    assert [e.metadata["rewards"]["solver"] for e in buffer.episodes] == [0.0, 0.0]
    # The judge's turn is recorded under its policy (a frozen one: the buffer drops it).
    assert [t.policy for t in buffer.episodes[0].turns] == ["solver", "judge"]


def test_a_reply_without_a_verdict_fails_the_episode_as_judge_error() -> None:
    report, buffer = _play(judge_rambles, {**VERDICTS, "constrained": False}, "4+0=")
    assert [e.reason for e in report.episodes] == ["judge_error"] * 2
    assert "judge agent 'judge' replied 'hmm'" in report.episodes[0].error
    assert buffer.episodes == [] and len(buffer.released) == 2


def test_the_message_and_the_verdict_of_a_free_reply() -> None:
    judge = Judge.parse({"verdicts": {"correct": 1.0, "wrong": -1.0, "unsure": 0.0}})
    text = judge.message("What is 2+2?", "4", None)
    assert "Question: What is 2+2?" in text and "Reference answer: (none)" in text
    assert text.endswith("Reply correct, wrong or unsure.")
    assert judge.verdict("It is WRONG... no, Correct.", episode="e") == "correct"
    assert judge.verdict("wrongly put, but wrong", episode="e") == "wrong"  # whole words only
    with pytest.raises(JudgeError, match="episode e: judge agent 'judge' replied 'incorrectly'"):
        judge.verdict("incorrectly", episode="e")


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ({"verdicts": {"yes": 1.0}}, "judge.verdicts must map at least two words"),
        ({"verdicts": {"yes please": 1.0, "no": 0.0}}, "judge.verdicts must be distinct single words"),
        ({"template": "Is it right?"}, "judge.template must contain {answer}"),
        ({"max_new_tokens": 0}, "judge.max_new_tokens must be >= 1"),
        ({"model": "x"}, r"judge: unknown fields \['model'\]"),
    ],
)
def test_bad_judge_arguments_are_refused_by_name(arg: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Judge.parse(arg)


def test_a_judge_with_a_reward_or_judging_itself_is_refused() -> None:
    with pytest.raises(ValueError, match="set reward or judge, not both"):
        PromptCompletion(reward="numeric", judge={})
    with pytest.raises(ValueError, match=r"judge\.agent must differ"):
        PromptCompletion(agent="judge", judge={"agent": "judge"})
