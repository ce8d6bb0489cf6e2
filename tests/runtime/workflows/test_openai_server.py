"""The OpenAI-compatible HTTP endpoint (workflows/openai_server.py), reached by the openai SDK's own
HTTP client and by raw aiohttp requests: a conversation through it is trained exactly as through the
in-process client (the same token ids, loss masks and versions), and every bad request gets an
OpenAI error object with its status code."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest
from fakes import FakeBuffer

from polyrl_runtime.engines.api import EngineUnavailableError, Generation, SamplingParams
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.models import Tokenizer, load_tokenizer
from polyrl_runtime.workflows.api import EpisodeContext
from polyrl_runtime.workflows.tools import CALCULATOR
from polyrl_testenv.inprocess import engine_routes
from polyrl_testenv.worker_jobs import worker_job

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>'
REPLIES = [CALL, "The answer is 7.", "Another reply.", "And one more."]


class _Generate:
    """Replies with the next of `REPLIES` (its end id after it), each at the next version."""

    def __init__(self, tok: Tokenizer, fail: bool) -> None:
        self.tok, self.fail, self.n = tok, fail, 0

    async def _generation(self) -> Generation:
        if self.fail:
            raise EngineUnavailableError("engine e0 of policy solver died")
        assert self.tok.eos_id is not None
        ids = [*self.tok.encode(REPLIES[self.n % len(REPLIES)]), self.tok.eos_id]
        version, self.n = self.n, self.n + 1
        k = len(ids)
        return Generation(
            np.asarray(ids, np.int32), np.full(k, -0.25, np.float32), np.full(k, version, np.int32), "stop"
        )

    def remote(self, prompt: list[int], params: SamplingParams) -> Awaitable[Generation]:
        return self._generation()


class ScriptedEngine:
    def __init__(self, tok: Tokenizer, fail: bool = False) -> None:
        self.generate = _Generate(tok, fail)


@pytest.fixture(scope="module")
def tok(tiny_qwen2_dir: Path) -> Tokenizer:
    return load_tokenizer(f"file://{tiny_qwen2_dir}")


def _context(tok: Tokenizer, fail: bool = False) -> EpisodeContext:
    engines = {p: {"e0": ScriptedEngine(tok, fail)} for p in ("solver", "planner")}
    sampling = {p: SamplingParams(temperature=1.0, max_new_tokens=64) for p in ("solver", "planner")}
    return EpisodeContext(
        "ep-1", "g-1", 0, 0, EnginePool(engine_routes(engines)), {"solver": tok, "planner": tok}, sampling,
        agent_policies={"solver": "solver", "planner": "planner"},
    )  # fmt: skip


QUESTION: list[dict[str, Any]] = [{"role": "user", "content": "what is 3+4?"}]


async def _conversation(create: Callable[..., Awaitable[Any]]) -> None:
    """Ask, get a tool call, send its result, get the answer: one conversation of two calls."""
    first = await create(model="solver", messages=QUESTION, tools=[CALCULATOR])
    message = first.choices[0].message
    assert (
        first.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "calculator"
    )
    history = [
        *QUESTION,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "7"},
    ]
    second = await create(model="solver", messages=history, tools=[CALCULATOR])
    assert second.choices[0].message.content == "The answer is 7."


def _turns(ctx: EpisodeContext) -> list[tuple[Any, ...]]:
    """Each training sequence: prompt and response ids, loss mask, versions, logprobs, temperature."""
    return [
        (t.prompt_ids.tolist(), t.response_ids.tolist(), t.loss_mask.tolist(), t.versions.tolist(),
         t.logprobs.tolist(), t.temperature)
        for t in ctx.turns
    ]  # fmt: skip


def test_a_conversation_through_http_is_trained_as_through_the_in_process_client(tok: Tokenizer) -> None:
    async def go() -> tuple[EpisodeContext, EpisodeContext]:
        local = _context(tok)
        await _conversation(local.openai("solver").chat.completions.create)
        remote = _context(tok)
        url = await remote.openai_base_url("solver")
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            await _conversation(client.chat.completions.create)
            models = await client.models.list()
            assert [m.id for m in models.data] == ["solver"]
        remote.close_endpoints()
        return local, remote

    local, remote = asyncio.run(go())
    assert len(remote.turns) == 1  # the two calls are one conversation: one training sequence
    assert _turns(remote) == _turns(local)
    assert set(remote.turns[0].versions.tolist()) >= {0, 1}  # each reply's tokens at their version


def test_streaming_n_and_several_agents_on_one_endpoint(tok: Tokenizer) -> None:
    async def go() -> EpisodeContext:
        ctx = _context(tok)
        url = await ctx.openai_base_url()  # every agent, by name
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            assert sorted(m.id for m in (await client.models.list()).data) == ["planner", "solver"]
            stream = await client.chat.completions.create(
                model="planner", messages=QUESTION, stream=True, stream_options={"include_usage": True}
            )
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == CALL and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
            both = await client.chat.completions.create(model="solver", messages=QUESTION, n=2)
            assert [c.index for c in both.choices] == [0, 1]
            assert [c.message.content for c in both.choices] == [CALL, REPLIES[1]]
        return ctx

    ctx = asyncio.run(go())
    # the planner's call and the solver's two completions: three sequences, each of its agent
    assert [t.agent for t in ctx.turns] == ["planner", "solver", "solver"]


def test_bad_requests_get_openai_errors_and_repeats_are_not_trained_twice(tok: Tokenizer) -> None:
    async def go() -> EpisodeContext:
        ctx = _context(tok)
        url = await ctx.openai_base_url("solver")
        async with aiohttp.ClientSession() as http:

            async def post(body: bytes, at: str = url) -> tuple[int, Any]:
                async with http.post(f"{at}/chat/completions", data=body) as r:
                    return r.status, await r.json()

            status, err = await post(b"{not json")
            assert status == 400 and "not valid JSON" in err["error"]["message"]
            assert err["error"]["type"] == "invalid_request_error"
            status, err = await post(json.dumps({"model": "judge", "messages": QUESTION}).encode())
            assert (
                status == 404
                and err["error"]["code"] == "model_not_found"
                and "serves solver" in err["error"]["message"]
            )
            status, err = await post(
                json.dumps({"model": "solver", "messages": QUESTION, "logprobs": True}).encode()
            )
            assert (status, err["error"]["param"]) == (400, "logprobs")
            status, err = await post(
                json.dumps(
                    {
                        "model": "solver",
                        "messages": QUESTION,
                        "tool_choice": "required",
                        "tools": [CALCULATOR],
                    }
                ).encode()
            )
            assert status == 400 and "tool_choice" in err["error"]["message"]
            status, err = await post(json.dumps({"model": "solver", "messages": QUESTION, "n": 0}).encode())
            assert (status, err["error"]["param"]) == (400, "n")
            body = json.dumps({"model": "solver", "messages": QUESTION}).encode()
            first, again = await asyncio.gather(post(body), post(body))  # a retry while the first runs
            assert first == again and first[0] == 200
            assert (await post(body)) == first  # and after it finished
            status, err = await post(body, at=url.replace("/k/", "/k/x"))
            assert status == 401 and err["error"]["code"] == "invalid_api_key"
            ctx.close_endpoints()
            status, err = await post(body)
            assert status == 401 and "episode ep-1 has ended" in err["error"]["message"]
        return ctx

    ctx = asyncio.run(go())
    assert len(ctx.turns) == 1  # the three copies of one request: one sample


def test_an_engine_failure_is_a_503_and_kept_on_the_episode(tok: Tokenizer) -> None:
    async def go() -> EpisodeContext:
        ctx = _context(tok, fail=True)
        url = await ctx.openai_base_url("solver")
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            with pytest.raises(openai.InternalServerError, match="engine e0 of policy solver died") as e:
                await client.chat.completions.create(model="solver", messages=QUESTION)
            assert e.value.status_code == 503
        return ctx

    ctx = asyncio.run(go())
    assert [type(e) for e in ctx.endpoint_errors] == [EngineUnavailableError] and not ctx.turns


def test_an_episode_whose_endpoint_call_met_an_engine_failure_counts_as_engine_error(
    tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "data"))
    from polyrl_runtime.experience.client import BufferClient
    from polyrl_runtime.experience.types import Ticket
    from polyrl_runtime.workflows.runner import WorkflowWorker

    solver = {"name": "solver", "model": {"uri": "builtin://tiny-qwen2"}, "algorithm": {"groupSize": 2},
              "rollout": {"engine": "torch", "gpus": 0}}  # fmt: skip
    spec = worker_job("endpoint_workflows:AskOnce", [solver], {"policies": {"solver": "solver"}})
    for fail, reason in ((True, "engine_error"), (False, "")):
        buffer = FakeBuffer()
        engines = engine_routes({"solver": {"e0": ScriptedEngine(tok, fail)}})
        worker = WorkflowWorker("w", spec, BufferClient(buffer), engines)
        report = asyncio.run(worker.run_group("g", 1, [Ticket(i, frozenset({"solver"})) for i in range(2)]))
        assert [ep.reason for ep in report.episodes] == [reason] * 2, report
        if fail:
            assert "through the OpenAI endpoint: engine e0 of policy solver died" in report.episodes[0].error
        else:
            assert len(buffer.episodes) == 2  # trained: one sequence each


def test_requests_still_running_when_the_episode_ends_are_cancelled(tok: Tokenizer) -> None:
    started = asyncio.Event()

    class Slow:
        async def _generation(self) -> Generation:
            started.set()
            await asyncio.sleep(60)
            raise AssertionError("not cancelled")

        def remote(self, prompt: list[int], params: SamplingParams) -> Awaitable[Generation]:
            return self._generation()

    class SlowEngine:
        generate = Slow()

    async def go() -> None:
        ctx = _context(tok)
        ctx.pool = EnginePool(engine_routes({"solver": {"e0": SlowEngine()}}))
        url = await ctx.openai_base_url("solver")
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as client:
            call = asyncio.create_task(client.chat.completions.create(model="solver", messages=QUESTION))
            await asyncio.wait_for(started.wait(), 10)
            ctx.close_endpoints()
            with pytest.raises(openai.APIError):
                await asyncio.wait_for(call, 10)  # the server dropped it: no 60 s wait
        assert not ctx.turns

    asyncio.run(go())
