"""`agent.chat` and the OpenAI-compatible client read a reply the same way: the same model outputs
(well-formed calls, arguments that are not JSON, a tool that was not offered, unclosed tags, plain
text, ...) are fed through both, and each is classified identically (text, calls or malformed), with
the same message. A malformed call never comes back from the client as plain text: it is a tool call
with the arguments as the model wrote them, `finish_reason` "tool_calls" and a `tool_error`."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageFunctionToolCall

from polyrl_runtime.engines.api import Generation, SamplingParams
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.models import Tokenizer, load_tokenizer
from polyrl_runtime.workflows.api import EpisodeContext
from polyrl_runtime.workflows.chat import ChatReply
from polyrl_runtime.workflows.openai_client import tool_error
from polyrl_runtime.workflows.tools import CALCULATOR
from polyrl_testenv.inprocess import engine_routes

QUESTION = [{"role": "user", "content": "what is 3+4?"}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>'
CALL2 = '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}\n</tool_call>'
ARGS_NOT_JSON = '<tool_call>{"name": "calculator", "arguments": "{expression: 3+4}"}</tool_call>'
BODY_NOT_JSON = '<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"</tool_call>'
UNKNOWN = '<tool_call>{"name": "search", "arguments": {"q": "3+4"}}</tool_call>'
UNCLOSED = '<tool_call>{"name": "calculator", "arguments": {"expression": "3+'
CLOSE_ONLY = '{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>'
NO_NAME = '<tool_call>{"arguments": {"expression": "3+4"}}</tool_call>'


@dataclass(frozen=True)
class Case:
    output: str  # what the model samples
    kind: str  # how both must classify it
    names: tuple[str, ...] = ()  # the tool calls the client reports, in order
    tools: bool = True  # offered to the chat
    ended: bool = True  # the model sampled its end id (else the reply is cut at the token limit)


CASES = {
    "well-formed call": Case(CALL, "calls", ("calculator",)),
    "two calls and text": Case(f"Let me see.\n{CALL}\n{CALL2}", "calls", ("calculator", "calculator")),
    "arguments not JSON": Case(ARGS_NOT_JSON, "malformed", ("calculator",)),
    "block not JSON": Case(BODY_NOT_JSON, "malformed", ("calculator",)),
    "tool not offered": Case(UNKNOWN, "malformed", ("search",)),
    "unterminated tag": Case(UNCLOSED, "malformed", ("calculator",), ended=False),
    "closing tag only": Case(CLOSE_ONLY, "malformed", ("calculator",)),
    "no name": Case(NO_NAME, "malformed", ("",)),
    "one good one bad": Case(f"{CALL}{ARGS_NOT_JSON}", "malformed", ("calculator", "calculator")),
    "plain text": Case("7", "text"),
    "plain text cut": Case("the answer is", "text", ended=False),
    "tags but no tools offered": Case(CALL, "text", tools=False),
}


class _Generate:
    def __init__(self, tok: Tokenizer, case: Case) -> None:
        assert tok.eos_id is not None
        self.ids = tok.encode(case.output) + ([tok.eos_id] if case.ended else [])
        self.finish = "stop" if case.ended else "length"

    async def _generation(self) -> Generation:
        n = len(self.ids)
        ids = np.asarray(self.ids, dtype=np.int32)
        return Generation(ids, np.zeros(n, np.float32), np.zeros(n, np.int32), self.finish)

    def remote(self, prompt: list[int], params: SamplingParams) -> Any:
        return self._generation()


class ScriptedEngine:
    """An engine handle whose every reply is one case's output."""

    def __init__(self, tok: Tokenizer, case: Case) -> None:
        self.generate = _Generate(tok, case)


def _context(tok: Tokenizer, case: Case) -> EpisodeContext:
    pool = EnginePool(engine_routes({"solver": {"e0": ScriptedEngine(tok, case)}}))
    sampling = {"solver": SamplingParams(temperature=1.0, max_new_tokens=256)}
    return EpisodeContext("ep-1", "g-1", 0, 0, pool, {"solver": tok}, sampling)


def function_calls(completion: ChatCompletion) -> list[ChatCompletionMessageFunctionToolCall]:
    calls = completion.choices[0].message.tool_calls or []
    assert all(isinstance(c, ChatCompletionMessageFunctionToolCall) for c in calls)
    return [c for c in calls if isinstance(c, ChatCompletionMessageFunctionToolCall)]


def client_kind(completion: ChatCompletion) -> str:
    """How code written against the OpenAI SDK reads a completion (plus this client's tool_error)."""
    choice = completion.choices[0]
    if tool_error(choice.message) is not None:
        return "malformed"
    return "calls" if choice.finish_reason == "tool_calls" else "text"


@pytest.fixture(scope="module")
def tok(tiny_qwen2_dir: Path) -> Tokenizer:
    return load_tokenizer(f"file://{tiny_qwen2_dir}")


def _both(tok: Tokenizer, case: Case) -> tuple[ChatReply, ChatCompletion]:
    tools = [CALCULATOR] if case.tools else None

    async def go() -> tuple[ChatReply, ChatCompletion]:
        reply = await _context(tok, case).agent("solver").chat(QUESTION, tools=tools)
        client = _context(tok, case).openai("solver")
        return reply, await client.chat.completions.create(messages=QUESTION, tools=tools)

    return asyncio.run(go())


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_agent_chat_and_the_client_classify_each_reply_alike(tok: Tokenizer, case: Case) -> None:
    reply, completion = _both(tok, case)
    assert reply.raw_text == case.output
    assert reply.kind == client_kind(completion) == case.kind
    choice = completion.choices[0]
    message = choice.message
    # the same error text, and the same history message (content and every call as written)
    assert tool_error(message) == reply.tool_error
    assert (case.kind == "malformed") == (reply.tool_error is not None)
    assert message.content == reply.message["content"]
    calls = function_calls(completion)
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"])
        for c in reply.message.get("tool_calls", [])
    ]
    assert tuple(c.function.name for c in calls) == case.names
    if case.kind == "text":
        assert message.content == case.output and reply.text == case.output
        assert choice.finish_reason == ("stop" if case.ended else "length")
    else:  # never plain text: a call, malformed or not, is reported as a tool call
        assert choice.finish_reason == "tool_calls" and calls
    if case.kind == "calls":
        assert [c.name for c in reply.tool_calls] == list(case.names)
        assert [json.loads(c.function.arguments) for c in calls] == [c.arguments for c in reply.tool_calls]
    if case.kind == "malformed":
        assert reply.tool_calls == () and reply.text == case.output  # nothing half-executed
        assert any((c.model_extra or {}).get("error") for c in calls)


def test_arguments_that_are_not_json_come_back_as_the_model_wrote_them(tok: Tokenizer) -> None:
    _, completion = _both(tok, CASES["arguments not JSON"])
    [call] = function_calls(completion)
    assert call.function.arguments == "{expression: 3+4}"  # the raw string, as the SDK returns it
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    error = tool_error(completion.choices[0].message)
    assert error is not None and "'arguments' is a string that is not JSON" in error


@pytest.mark.parametrize("name", ["arguments not JSON", "tool not offered", "well-formed call"])
def test_the_client_continues_the_conversation_after_any_call(tok: Tokenizer, name: str) -> None:
    """The SDK message of a call, malformed or not, and a tool answer to it continue the same
    conversation: one training sequence."""

    async def go() -> EpisodeContext:
        ctx = _context(tok, CASES[name])
        client = ctx.openai("solver")
        first = await client.chat.completions.create(messages=QUESTION, tools=[CALCULATOR])
        message = first.choices[0].message
        [call, *_] = function_calls(first)
        answer = {"role": "tool", "tool_call_id": call.id, "content": tool_error(message) or "7"}
        await client.chat.completions.create(messages=[*QUESTION, message, answer], tools=[CALCULATOR])
        return ctx

    ctx = asyncio.run(go())
    [turn] = ctx.turns
    assert not turn.loss_mask.all()  # two sampled replies around the tool's answer (context)
