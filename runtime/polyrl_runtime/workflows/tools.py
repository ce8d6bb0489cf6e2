"""Tool calls in model replies, and a calculator tool.

Replies are parsed in the Hermes format that Qwen2.5/Qwen3 chat templates teach their models:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3+4"}}
    </tool_call>

any number of blocks, with free text around them. `parse_tool_calls` is the one parser of replies:
`agent.chat` and the OpenAI-compatible client both read its result, so they classify every reply
the same way (`ParsedReply.kind`):

- "text": no tool-call tags (or no tools were offered: then the reply is not parsed at all);
- "calls": every block is a JSON object with a `name` among the tools offered and `arguments` that
  are an object (or a JSON string of one, as OpenAI writes them);
- "malformed": any block is not (bad JSON, no `name`, a tool that was not offered, arguments that are
  not an object, a `<tool_call>` never closed, a `</tool_call>` never opened). That is not an error of
  the episode: `error` says what is wrong, `tool_calls` is empty (nothing half-executed) and
  `written` still holds every block as the model wrote it, as an OpenAI-compatible server reports
  it: `arguments` is then the model's own text (a JSON string it wrote, or the block's whole text
  when the block is not JSON at all), so `json.loads` fails on it just as on the SDK's.

Tools are given to `agent.chat(..., tools=[...])` as OpenAI-style function schemas; the chat template
renders them.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


ReplyKind = Literal["text", "calls", "malformed"]


def reply_kind(tool_calls: Sequence[ToolCall], error: str | None) -> ReplyKind:
    """How a parsed reply reads (module doc)."""
    if error is not None:
        return "malformed"
    return "calls" if tool_calls else "text"


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` as decoded JSON."""

    id: str
    name: str
    arguments: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The call as an OpenAI assistant message's `tool_calls` entry (arguments as a JSON string)."""
        return WrittenCall(self.id, self.name, json.dumps(self.arguments)).as_openai()


@dataclass(frozen=True)
class WrittenCall:
    """One tool-call block as the model wrote it, parsed or not: what an OpenAI-compatible server
    returns for it. `arguments` is a JSON text for a call that parsed; for a malformed one the model's
    own text (module doc), with `error` saying why it is malformed."""

    id: str
    name: str
    arguments: str
    error: str | None = None

    def as_openai(self) -> dict[str, Any]:
        """The block as an OpenAI assistant message's `tool_calls` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into its text and its tool calls (module doc).

    `content`: the reply without the call blocks, or the whole reply when a call is malformed;
    `tool_calls`: the parsed calls (none when one is malformed); `error`: why they are malformed;
    `written`: every block as written, parsed or not; `outside`: the reply without the blocks."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    error: str | None = None
    written: tuple[WrittenCall, ...] = ()
    outside: str = ""

    @property
    def kind(self) -> ReplyKind:
        return reply_kind(self.tool_calls, self.error)


def tool_names(tools: Iterable[Mapping[str, Any]] | None) -> frozenset[str] | None:
    """The function names of OpenAI tool schemas (`{"type": "function", "function": {"name": ...}}`,
    or the older bare `{"name": ...}`); None when any schema has no name: then names are not checked."""
    names: set[str] = set()
    for tool in tools or ():
        fn = tool.get("function", tool)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            return None
        names.add(name)
    return frozenset(names) if names else None


def _blocks(text: str) -> tuple[list[tuple[str, str | None]], str]:
    """The tool-call blocks of `text` in order, each as (body, what is wrong with its tags or None),
    and the text outside them (stripped). A `</tool_call>` with no opening tag closes a block that
    starts where the previous one ended (a model that left out the opening tag)."""
    blocks: list[tuple[str, str | None]] = []
    outside: list[str] = []
    pos = 0
    while True:
        o, c = text.find(_OPEN, pos), text.find(_CLOSE, pos)
        if o < 0 and c < 0:
            outside.append(text[pos:])
            break
        if o >= 0 and (c < 0 or o < c):
            outside.append(text[pos:o])
            start = o + len(_OPEN)
            end = text.find(_CLOSE, start)
            if end < 0:
                blocks.append((text[start:], f"{_OPEN} is never closed by {_CLOSE}"))
                break
            blocks.append((text[start:end], None))
            pos = end + len(_CLOSE)
        else:
            blocks.append((text[pos:c], f"{_CLOSE} without an opening {_OPEN}"))
            pos = c + len(_CLOSE)
    return blocks, "".join(outside).strip()


def _one_call(body: str, call_id: str, names: frozenset[str] | None) -> ToolCall | str:
    """The call in one block's body, or why it is malformed."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"tool call {call_id} is not JSON: {e.msg} at char {e.pos}"
    if not isinstance(obj, dict):
        return f"tool call {call_id} is not a JSON object"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"tool call {call_id} has no 'name'"
    if names is not None and name not in names:
        return f"tool call {call_id} calls {name!r}, which is not a tool offered ({', '.join(sorted(names))})"
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI does
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f"tool call {call_id} ({name}): 'arguments' is a string that is not JSON"
    if not isinstance(args, dict):
        return f"tool call {call_id} ({name}): 'arguments' is not an object"
    return ToolCall(call_id, name, args)


def _as_written(body: str, call_id: str, error: str) -> WrittenCall:
    """A malformed block as an OpenAI-compatible server reports it: the name if one can be read, and
    the model's text of the arguments (the block's whole text when it is not a JSON object)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        name, args = obj.get("name"), obj.get("arguments", {})
        arguments = args if isinstance(args, str) else json.dumps(args)
        return WrittenCall(call_id, name if isinstance(name, str) else "", arguments, error)
    m = _NAME.search(body)
    try:
        name = json.loads(f'"{m.group(1)}"') if m else ""
    except json.JSONDecodeError:
        name = m.group(1) if m else ""
    return WrittenCall(call_id, str(name), body.strip(), error)


def parse_tool_calls(
    text: str, *, id_prefix: str = "call", tools: Sequence[Mapping[str, Any]] | None = None
) -> ParsedReply:
    """Split `text` into content and Hermes-format tool calls (ids `<id_prefix>_<i>`); with `tools`
    (OpenAI schemas), a call to a name that is not among them is malformed."""
    blocks, outside = _blocks(text)
    if not blocks:
        return ParsedReply(text, outside=text)
    names = tool_names(tools)
    calls: list[ToolCall] = []
    written: list[WrittenCall] = []
    errors: list[str] = []
    for i, (body, tag_error) in enumerate(blocks):
        call_id = f"{id_prefix}_{i}"
        call = f"tool call {call_id}: {tag_error}" if tag_error else _one_call(body.strip(), call_id, names)
        if isinstance(call, ToolCall):
            calls.append(call)
            written.append(WrittenCall(call_id, call.name, json.dumps(call.arguments)))
        else:
            errors.append(call)
            written.append(_as_written(body, call_id, call))
    if errors:
        return ParsedReply(text, (), "; ".join(errors), tuple(written), outside)
    return ParsedReply(outside, tuple(calls), None, tuple(written), outside)


# -- a calculator tool --------------------------------------------------------------------------

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 3+4*2"}},
            "required": ["expression"],
        },
    },
}

_OPS: Mapping[type[ast.AST], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}
MAX_ABS = 10**12  # results beyond this are refused: a model may write 9*9*9*... of any length


class CalculatorError(ValueError):
    """The expression is not integer arithmetic the calculator evaluates."""


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_eval(node.left), _eval(node.right))
        if abs(value) > MAX_ABS:
            raise CalculatorError(f"result exceeds {MAX_ABS}")
        return value
    raise CalculatorError(f"unsupported element {type(node).__name__}")


def calculate(expression: str) -> int:
    """The value of an integer expression with + - * and parentheses (no names, no calls)."""
    if len(expression) > 200:
        raise CalculatorError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an expression: {expression!r}") from e
    return _eval(tree.body)


@dataclass(frozen=True)
class ToolResult:
    """What a tool returned to one call, as the `tool` message the conversation continues with."""

    call_id: str
    content: str
    ok: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def message(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.content}


def run_calculator(call: ToolCall) -> ToolResult:
    """Run a `calculator` call: the value, or the error as the tool's text (never raises)."""
    expr = call.arguments.get("expression")
    if call.name != "calculator" or not isinstance(expr, str):
        return ToolResult(call.id, f"error: expected calculator(expression: str), got {call.name}", ok=False)
    try:
        return ToolResult(call.id, str(calculate(expr)))
    except CalculatorError as e:
        return ToolResult(call.id, f"error: {e}", ok=False)
