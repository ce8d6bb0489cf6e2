"""Tool-call parsing (Hermes/Qwen format), per-turn rewards in an agent's return, and the OpenAI
response built from a reply."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall

from polyrl_runtime.workflows.api import Outcome
from polyrl_runtime.workflows.chat import ChatReply
from polyrl_runtime.workflows.openai_client import completion_of, tool_error
from polyrl_runtime.workflows.tools import ParsedReply, ToolCall, WrittenCall, parse_tool_calls, tool_names

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
        (
            f"{ADD}<tool_call>{{",
            ParsedReply(f"{ADD}<tool_call>{{", (), "tool call c_1: <tool_call> is never closed"),
        ),
        (
            f'{{"name": "add"}}</tool_call>{ADD}',
            ParsedReply(
                f'{{"name": "add"}}</tool_call>{ADD}', (), "tool call c_0: </tool_call> without an opening"
            ),
        ),
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
        assert got.kind == "malformed" and got.written  # every block is still reported as written


ARGS_TEXT = '<tool_call>{"name": "add", "arguments": "{a: 1}"}</tool_call>'
CUT = '<tool_call>{"name": "add", "arguments": {"a": 1'


@pytest.mark.parametrize(
    ("text", "written"),
    [
        (ADD, [WrittenCall("c_0", "add", '{"a": 1, "b": 2}')]),
        # arguments as a string that is not JSON: that string, as the OpenAI API returns arguments
        (ARGS_TEXT, [WrittenCall("c_0", "add", "{a: 1}", "tool call c_0 (add): 'arguments' is a string")]),
        # a block that is not JSON: its name where one can be read, and its whole text
        (
            f"{CUT}</tool_call>",
            [WrittenCall("c_0", "add", CUT.removeprefix("<tool_call>"), "tool call c_0 is not")],
        ),
        (
            CUT,
            [
                WrittenCall(
                    "c_0", "add", CUT.removeprefix("<tool_call>"), "tool call c_0: <tool_call> is never"
                )
            ],
        ),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            [WrittenCall("c_0", "f", "[1]", "tool call c_0 (f)")],
        ),
        ("<tool_call>oops</tool_call>", [WrittenCall("c_0", "", "oops", "tool call c_0 is not JSON")]),
        (
            f"{ADD} then <tool_call>oops</tool_call>",
            [
                WrittenCall("c_0", "add", '{"a": 1, "b": 2}'),
                WrittenCall("c_1", "", "oops", "tool call c_1 is not"),
            ],
        ),
    ],
)
def test_every_block_is_reported_as_written(text: str, written: list[WrittenCall]) -> None:
    got = parse_tool_calls(text, id_prefix="c").written
    assert [(w.id, w.name, w.arguments) for w in got] == [(w.id, w.name, w.arguments) for w in written]
    for g, w in zip(got, written, strict=True):
        assert (g.error is None) == (w.error is None)
        assert w.error is None or (g.error is not None and g.error.startswith(w.error))


def test_a_call_to_a_tool_not_offered_is_malformed() -> None:
    tools = [{"type": "function", "function": {"name": "mul", "parameters": {}}}]
    got = parse_tool_calls(ADD, id_prefix="c", tools=tools)
    assert got.kind == "malformed" and got.tool_calls == ()
    assert got.error == "tool call c_0 calls 'add', which is not a tool offered (mul)"
    assert parse_tool_calls(ADD, id_prefix="c", tools=[*tools, {"name": "add"}]).kind == "calls"
    # a schema without a name: names are not checked
    assert parse_tool_calls(ADD, id_prefix="c", tools=[{"type": "function"}]).kind == "calls"
    assert tool_names([{"type": "function", "function": {"name": "a"}}, {"name": "b"}]) == frozenset("ab")


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
    assert tool_error(plain.choices[0].message) is None


def test_completion_of_a_malformed_call_is_a_tool_call_with_raw_arguments() -> None:
    text = f"let me see {ARGS_TEXT}"
    reply = ChatReply.of(text, [5, 6], "stop", parse_tool_calls(text, id_prefix="call"))
    assert reply.kind == "malformed" and reply.text == text and reply.tool_calls == ()
    choice = completion_of(reply, model="solver", prompt_tokens=3, created=1).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "let me see"
    [tc] = choice.message.tool_calls or []
    assert isinstance(tc, ChatCompletionMessageToolCall)
    assert (tc.id, tc.function.name, tc.function.arguments) == ("call_0", "add", "{a: 1}")
    with pytest.raises(json.JSONDecodeError):
        json.loads(tc.function.arguments)
    assert tool_error(choice.message) == reply.tool_error
    assert (tc.model_extra or {})["error"] == reply.tool_error
    # the SDK message is the reply's own history message (so a conversation continues either way)
    dumped = choice.message.model_dump(exclude_none=True)
    assert {k: dumped[k] for k in ("role", "content", "tool_calls")} == {
        **reply.message,
        "tool_calls": [{**reply.message["tool_calls"][0], "error": reply.tool_error}],
    }
