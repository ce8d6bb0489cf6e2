"""Tool calls in model replies, and a calculator tool.

Replies are parsed in the Hermes format that Qwen2.5/Qwen3 chat templates teach their models:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3+4"}}
    </tool_call>

any number of blocks, with free text around them. A reply whose blocks do not all parse (bad JSON, no
`name`, arguments that are not an object, an unclosed tag) is not an error of the episode: it comes
back as plain text with `error` saying what is wrong, so a workflow can penalise it. Tools are given to
`agent.chat(..., tools=[...])` as OpenAI-style function schemas; the chat template renders them.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` as decoded JSON."""

    id: str
    name: str
    arguments: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The call as an OpenAI assistant message's `tool_calls` entry (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into its text (without the call blocks) and its tool calls; on a malformed call
    `content` is the whole reply, `tool_calls` is empty and `error` says why."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    error: str | None = None


def _one_call(body: str, call_id: str) -> ToolCall | str:
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
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI does
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f"tool call {call_id} ({name}): 'arguments' is a string that is not JSON"
    if not isinstance(args, dict):
        return f"tool call {call_id} ({name}): 'arguments' is not an object"
    return ToolCall(call_id, name, args)


def parse_tool_calls(text: str, *, id_prefix: str = "call") -> ParsedReply:
    """Split `text` into content and Hermes-format tool calls (ids `<id_prefix>_<i>`)."""
    if _OPEN not in text and _CLOSE not in text:
        return ParsedReply(text)
    calls: list[ToolCall] = []
    for i, m in enumerate(_BLOCK.finditer(text)):
        call = _one_call(m.group(1).strip(), f"{id_prefix}_{i}")
        if isinstance(call, str):
            return ParsedReply(text, (), call)
        calls.append(call)
    rest = _BLOCK.sub("", text)
    if _OPEN in rest or _CLOSE in rest:
        return ParsedReply(text, (), "unbalanced <tool_call> tags")
    return ParsedReply(rest.strip(), tuple(calls))


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
