"""DAPO's filters and length penalty on the workflow worker: the turns it marks for the buffer to
drop (equal-reward groups under dynamicSampling, turns cut at their maximum new tokens under
overlongFilter) and the soft overlong penalty added to the rewards, against their formulas."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from fakes import FakeBuffer, _Method

from polyrl_operator.api import RLJob
from polyrl_operator.api.policy import Policy
from polyrl_runtime.engines.api import Generation, SamplingParams
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.experience.state import FILTERED_KEY
from polyrl_runtime.experience.types import Ticket
from polyrl_runtime.models import CharTokenizer
from polyrl_runtime.workflows.api import CallRecord, EpisodeContext, Outcome
from polyrl_runtime.workflows.groups import equal_reward_agents
from polyrl_runtime.workflows.overlong import Ramp, overlong_penalties, overlong_turns
from polyrl_runtime.workflows.runner import WorkflowWorker
from polyrl_testenv.inprocess import engine_routes

TOK = CharTokenizer()


class Engine:
    """Answers `n:K` prompts with K letters, finishing "length" when K reaches the call's limit."""

    def __init__(self) -> None:
        def generate(prompt: list[int], params: SamplingParams) -> Generation:
            k = min(int(TOK.decode(prompt).rsplit(":", 1)[1]), params.max_new_tokens)
            reason = "length" if k >= params.max_new_tokens else "stop"
            ids = np.full(k, TOK.token_id("a"), dtype=np.int32)
            return Generation(ids, np.full(k, -0.5, np.float32), np.zeros(k, np.int32), reason)

        self.generate = _Method(generate)


class Lengths:
    """The speaker replies with episode index + 1 tokens (at most 4); the listener's reward is 1 on
    odd episodes, the speaker's always 1."""

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        await ctx.agent("speaker").generate(f"n:{ctx.index + 1}", max_new_tokens=4)
        await ctx.agent("listener").generate("n:1", max_new_tokens=4)
        return Outcome({"speaker": 1.0, "listener": float(ctx.index % 2)})


def _job(algorithm: dict[str, Any]) -> str:
    doc = {
        "apiVersion": "polyrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "t"},
        "spec": {
            "training": {"totalSteps": 1},
            "workflow": {"entrypoint": f"{__name__}:Lengths"},
            "policies": [
                {
                    "name": n,
                    "model": {"uri": "builtin://tiny"},
                    "algorithm": {"groupSize": 4, **algorithm},
                    "rollout": {"engine": "torch", "gpus": 0, "sampling": {"maxNewTokens": 4}},
                }
                for n in ("speaker", "listener")
            ],
        },
    }
    return RLJob.model_validate(doc).model_dump_json(by_alias=True)


def _run(algorithm: dict[str, Any]) -> list[Any]:
    routes = {"speaker": {"s": Engine()}, "listener": {"l": Engine()}}
    buffer = FakeBuffer()
    worker = WorkflowWorker("w", _job(algorithm), BufferClient(buffer), engine_routes(routes))
    tickets = [Ticket(i, frozenset({"speaker", "listener"})) for i in range(4)]
    asyncio.run(worker.run_group("g", 3, tickets))
    return sorted(buffer.episodes, key=lambda e: e.episode_id)


def test_dynamic_sampling_marks_the_turns_of_agents_whose_group_rewards_are_equal() -> None:
    episodes = _run({"dynamicSampling": {}})
    # The speaker's four rewards are all 1 (turn 0 of each episode); the listener's differ.
    assert [e.metadata[FILTERED_KEY] for e in episodes] == [{"zero_variance": [0]}] * 4
    assert all(e.rewards["speaker"] == 0.0 for e in episodes)
    assert all(FILTERED_KEY not in e.metadata for e in _run({}))


def test_overlong_filter_marks_the_turns_cut_at_their_limit() -> None:
    episodes = _run({"overlongFilter": True})
    # Only the last episode's speaker reached its 4 tokens.
    assert [e.metadata.get(FILTERED_KEY) for e in episodes] == [None, None, None, {"overlong": [0]}]


def test_the_soft_overlong_penalty_is_in_the_rewards_and_the_group_signal() -> None:
    episodes = _run({"overlongPenalty": {"bufferTokens": 2}})
    # 1..4 tokens against a ramp from 2 to 4 (maxNewTokens): 0, 0, -0.5, -1.
    assert [e.metadata["rewards"]["speaker"] for e in episodes] == [1.0, 1.0, 0.5, 0.0]
    assert [e.rewards["speaker"] for e in episodes] == pytest.approx([0.375, 0.375, -0.125, -0.625])
    # Both marks on one episode: the filters meet in one metadata entry.
    both = _run({"overlongFilter": True, "dynamicSampling": {}})
    assert both[3].metadata[FILTERED_KEY] == {"overlong": [0], "zero_variance": [0]}


def test_the_ramp_against_dapos_formula() -> None:
    ramp = Ramp(buffer=4, max_length=10, factor=2.0)
    assert [ramp.penalty(n) for n in (1, 6, 7, 8, 10, 11)] == [0.0, 0.0, -0.5, -1.0, -2.0, -2.0]
    policy = Policy.model_validate(
        {
            "name": "p",
            "model": {"uri": "builtin://tiny"},
            "algorithm": {"overlongPenalty": {"bufferTokens": 8}},
            "rollout": {"sampling": {"maxNewTokens": 32}},
        }
    )
    assert Ramp.of(policy) == Ramp(8, 32, 1.0)
    explicit = policy.model_copy(
        update={"algorithm": policy.algorithm.model_copy(update={"overlong_penalty": None})}
    )
    assert Ramp.of(explicit) is None
    calls = [
        CallRecord("a", "p", 0, 7, False),
        CallRecord("a", "p", 1, 8, True),
        CallRecord("b", "q", 2, 9, True),
    ]
    assert overlong_penalties(calls, {"p": ramp}) == {"a": -1.5}
    assert overlong_turns(calls, frozenset({"p"})) == [1]
    assert overlong_turns(calls, frozenset({"p", "q"})) == [1, 2]


def test_equal_rewards_are_found_per_sub_group_and_position() -> None:
    rewards = [{"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 1.0}, {"a": 0.0, "b": 1.0}, {"a": 1.0, "b": 1.0}]
    # a in sub-groups of 2: (1, 1) equal, (0, 1) not; b in one group of 4: not equal.
    assert equal_reward_agents(rewards, {"a": 2, "b": 4}) == [{"a"}, {"a"}, set(), set()]
    # Positions 0, 2, 3 finished (1 failed): a's first sub-group is position 0 alone, equal.
    assert equal_reward_agents(rewards[:3], {"a": 2}, [0, 2, 3]) == [{"a"}, set(), set()]
