"""Tool-call parsing (Hermes/Qwen format), per-turn rewards in an agent's return, and the OpenAI
response built from a reply."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall

from polyrl_runtime.workflows.api import Outcome
from polyrl_runtime.workflows.chat import ChatReply
from polyrl_runtime.workflows.openai_client import completion_of
from polyrl_runtime.workflows.tools import ParsedReply, ToolCall, parse_tool_calls

ADD = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
MUL = '<tool_call>\n{"name": "mul", "arguments": "{\\"a\\": 3}"}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("just text", ParsedReply("just text")),
        (ADD, ParsedReply("", (ToolCall("c_0", "add", {"a": 1, "b": 2}),))),
        (
            f"Let me compute.\n{ADD}\n{MUL}",
            ParsedReply(
                "Let me compute.",
                (ToolCall("c_0", "add", {"a": 1, "b": 2}), ToolCall("c_1", "mul", {"a": 3})),
            ),
        ),
        ('<tool_call>{"name": "add"}</tool_call>', ParsedReply("", (ToolCall("c_0", "add", {}),))),
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',
            ParsedReply(
                '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', (), "tool call c_0 is not JSON"
            ),
        ),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            ParsedReply('<tool_call>{"arguments": {}}</tool_call>', (), "tool call c_0 has no 'name'"),
        ),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            ParsedReply(
                '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
                (),
                "tool call c_0 (f): 'arguments' is not an object",
            ),
        ),
        (
            "<tool_call>[1, 2]</tool_call>",
            ParsedReply("<tool_call>[1, 2]</tool_call>", (), "tool call c_0 is not a JSON object"),
        ),
        (f"{ADD}<tool_call>{{", ParsedReply(f"{ADD}<tool_call>{{", (), "unbalanced <tool_call> tags")),
        # One good call and one bad: the whole reply is text, nothing half-executed.
        (
            f"{ADD}<tool_call>oops</tool_call>",
            ParsedReply(f"{ADD}<tool_call>oops</tool_call>", (), "tool call c_1 is not JSON"),
        ),
    ],
)
def test_parse_tool_calls(text: str, expected: ParsedReply) -> None:
    got = parse_tool_calls(text, id_prefix="c")
    assert (got.content, got.tool_calls) == (expected.content, expected.tool_calls)
    if expected.error is None:
        assert got.error is None
    else:
        assert got.error is not None and got.error.startswith(expected.error)


@pytest.mark.parametrize(
    ("rewards", "turn_rewards", "returns"),
    [
        ({"a": 1.0}, {}, {"a": 1.0}),
        ({"a": 1.0, "b": 0.0}, {"a": [0.5, 0.25]}, {"a": 1.75, "b": 0.0}),
        ({"a": 0.0}, {"b": [1.0]}, {"a": 0.0, "b": 1.0}),  # per-turn rewards alone make a return
    ],
)
def test_per_turn_rewards_sum_into_the_agents_return(
    rewards: dict[str, float], turn_rewards: dict[str, list[float]], returns: dict[str, float]
) -> None:
    assert Outcome(rewards, turn_rewards=turn_rewards).returns() == returns


def test_completion_of_a_reply_with_tool_calls() -> None:
    parsed = parse_tool_calls(f"thinking {ADD}", id_prefix="call")
    reply = ChatReply.of(f"thinking {ADD}", [5, 6, 7], "stop", parsed)
    c = completion_of(reply, model="solver", prompt_tokens=11, created=1)
    assert isinstance(c, ChatCompletion) and c.model == "solver"
    choice = c.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "thinking"
    [tc] = choice.message.tool_calls or []
    assert isinstance(tc, ChatCompletionMessageToolCall) and tc.id == "call_0"
    assert json.loads(tc.function.arguments) == {"a": 1, "b": 2}
    assert c.usage is not None and (c.usage.prompt_tokens, c.usage.completion_tokens) == (11, 3)
    # The message round-trips into the next request's history.
    assert reply.message["tool_calls"][0]["function"]["name"] == "add"
    plain = completion_of(ChatReply.of("hi", [1], "length", None), model="m", prompt_tokens=1, created=1)
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].message.tool_calls is None
