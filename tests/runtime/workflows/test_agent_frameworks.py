"""Two real agent frameworks trained unchanged through the episode's OpenAI endpoint: an OpenAI Agents
SDK agent with a tool (workflows/agents_sdk.py) and a LangGraph planner and solver, two policies
(workflows/langgraph_planner.py). Each framework's own HTTP client calls the endpoint; the training
sequences it leaves are exactly those of the in-process client given the same requests (token ids,
loss masks, versions, logprobs), and a framework that resends its history continues one sequence."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polyrl_runtime.engines.api import Generation, SamplingParams
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.models import Tokenizer, load_tokenizer
from polyrl_runtime.workflows import openai_server
from polyrl_runtime.workflows.agents_sdk import AgentsSdkCalculator
from polyrl_runtime.workflows.api import EpisodeContext, Outcome
from polyrl_runtime.workflows.langgraph_planner import LangGraphPlannerSolver
from polyrl_runtime.workflows.openai_client import OpenAIClient
from polyrl_testenv.inprocess import engine_routes

pytest.importorskip("agents")  # the `agents` extra, which the test tier installs


class _Script:
    """Replies with `replies` in order (its end id after each), the i-th at version i."""

    def __init__(self, tok: Tokenizer, replies: list[str]) -> None:
        self.tok, self.replies, self.n = tok, replies, 0

    async def _generation(self) -> Generation:
        assert self.tok.eos_id is not None
        ids = [*self.tok.encode(self.replies[self.n]), self.tok.eos_id]
        version, self.n = self.n, self.n + 1
        k = len(ids)
        return Generation(
            np.asarray(ids, np.int32), np.full(k, -0.5, np.float32), np.full(k, version, np.int32), "stop"
        )

    def remote(self, prompt: list[int], params: SamplingParams) -> Any:
        return self._generation()


class ScriptedEngine:
    def __init__(self, tok: Tokenizer, replies: list[str]) -> None:
        self.generate = _Script(tok, replies)


@pytest.fixture(scope="module")
def tok(tiny_qwen2_dir: Path) -> Tokenizer:
    return load_tokenizer(f"file://{tiny_qwen2_dir}")


def _context(tok: Tokenizer, scripts: dict[str, list[str]]) -> EpisodeContext:
    engines = {p: {"e0": ScriptedEngine(tok, replies)} for p, replies in scripts.items()}
    sampling = {p: SamplingParams(temperature=1.0, max_new_tokens=64) for p in scripts}
    return EpisodeContext(
        "ep-1", "g-1", 0, 0, EnginePool(engine_routes(engines)), dict.fromkeys(scripts, tok), sampling,
        agent_policies={p: p for p in scripts},
    )  # fmt: skip


def _recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every request the endpoint serves: (agent, `create`'s arguments)."""
    seen: list[tuple[str, dict[str, Any]]] = []

    class Recording(OpenAIClient):
        def __init__(self, agent: Any) -> None:
            super().__init__(agent)
            create = self.chat.completions.create

            async def recorded(**kwargs: Any) -> Any:
                seen.append((agent.name, json.loads(json.dumps(kwargs))))
                return await create(**kwargs)

            self.chat.completions.create = recorded  # type: ignore[method-assign]

    monkeypatch.setattr(openai_server, "OpenAIClient", Recording)
    return seen


def _turns(ctx: EpisodeContext) -> list[tuple[Any, ...]]:
    return [
        (t.agent, t.prompt_ids.tolist(), t.response_ids.tolist(), t.loss_mask.tolist(), t.versions.tolist(),
         t.logprobs.tolist())
        for t in ctx.turns
    ]  # fmt: skip


def _replayed(
    tok: Tokenizer, scripts: dict[str, list[str]], seen: list[tuple[str, dict[str, Any]]]
) -> EpisodeContext:
    """The same requests through the in-process client (`ctx.openai`), on the same replies."""
    ctx = _context(tok, scripts)

    async def go() -> None:
        for agent, kwargs in seen:
            await ctx.openai(agent).chat.completions.create(**kwargs)

    asyncio.run(go())
    return ctx


def _question(seed: int, max_operand: int = 9) -> tuple[int, int]:
    rng = random.Random(seed)  # what ctx.rng draws in the episode
    return rng.randint(0, max_operand), rng.randint(0, max_operand)


def test_an_agents_sdk_agent_with_a_tool_trains_as_one_sequence(
    tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = _question(0)
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}+{b}"}}}}</tool_call>'
    scripts = {"solver": [call, str(a + b)]}
    seen = _recorded(monkeypatch)
    ctx = _context(tok, scripts)
    outcome = asyncio.run(AgentsSdkCalculator().run_episode(ctx))
    assert isinstance(outcome, Outcome) and outcome.rewards == {"solver": 1.0}, outcome
    assert len(seen) == 2 and seen[1][1]["messages"][-1]["role"] == "tool"  # the SDK's own loop
    assert seen[1][1]["messages"][-1]["content"] == str(a + b)  # the calculator ran
    assert len(ctx.turns) == 1  # its resent history continued the conversation
    assert _turns(ctx) == _turns(_replayed(tok, scripts, seen))
    assert ctx.turns[0].versions.max() == 1 and not ctx.endpoint_errors


def test_a_langgraph_planner_and_solver_are_two_policies(
    tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = _question(0)
    scripts = {"planner": ["Add the two numbers."], "solver": [str(a + b)]}
    seen = _recorded(monkeypatch)
    ctx = _context(tok, scripts)
    outcome = asyncio.run(LangGraphPlannerSolver().run_episode(ctx))
    assert isinstance(outcome, Outcome) and outcome.rewards == {"planner": 1.0, "solver": 1.0}
    assert [agent for agent, _ in seen] == ["planner", "solver"]
    assert "Plan: Add the two numbers." in seen[1][1]["messages"][-1]["content"]  # the graph's state
    assert [(t.agent, t.policy) for t in ctx.turns] == [("planner", "planner"), ("solver", "solver")]
    assert _turns(ctx) == _turns(_replayed(tok, scripts, seen))
