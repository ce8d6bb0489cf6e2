"""A tool-using agent over two turns: arithmetic with a calculator, one conversation per episode.

    user:       compute 3+4
    assistant:  3+4                      <- turn 1: the calculator call (sampled, trained)
    tool:       7                        <- the calculator's result (context, not trained)
    assistant:  7                        <- turn 2: the answer (sampled, trained)

The whole exchange is ONE training sequence (workflows/chat.py): the two replies are trained, the
question, the tool's result and the template's tokens are context. With `compact: false` the
calculator is offered to the chat template as a tool schema, and a first reply in the Hermes format
(`<tool_call>{...}</tool_call>`) is parsed as a call (a malformed one gets the tool's error as its
result). A model too small to have learnt that format (`builtin://tiny-qwen2`, random weights) plays
`compact: true`, the default: it is constrained to the digits and operators its expressions and their
values use, its first reply is the calculator's expression itself, and it is shown no schema (the
schema alone would take most of the tiny model's 512 positions, and a constrained reply cannot
follow it anyway).

Rewards: 1 for the right final answer (a reply of just that number, ended by the model), as the
episode reward, `answer_credit` (0.5) for the right number not ended there; and a per-turn reward `call_reward` (0.5 by default) for a calculator call whose
value is the right answer, summed into the agent's return (`Outcome.turn_rewards`). The group's
episodes share the problem (drawn with `ctx.rng`). What the random model can learn here: to copy the
question's expression into its call, and the tool's result into its answer.
"""

from __future__ import annotations

from typing import Any

from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow
from polyrl_runtime.workflows.chat import ChatReply
from polyrl_runtime.workflows.tools import CALCULATOR, ToolCall, ToolResult, calculate, run_calculator

DIGITS = "0123456789"


def alphabet(max_operand: int, operators: str) -> set[str]:
    """The characters of every expression `a op b` (0 <= a, b <= max_operand) and of its value: a
    smaller alphabet gives a random model fewer ways to be wrong."""
    values = range(max_operand + 1)
    texts = [f"{a}{op}{b}{calculate(f'{a}{op}{b}')}" for a in values for b in values for op in operators]
    return set("".join(texts))


class Calculator(Workflow):
    def __init__(
        self,
        *,
        agent: str = "solver",
        max_operand: int = 4,
        operators: str = "+",
        compact: bool = True,
        call_reward: float = 0.5,
        reply_tokens: int = 4,
        answer_credit: float = 0.5,
        **args: Any,
    ) -> None:
        super().__init__(**args)
        if not 1 <= max_operand <= 99:
            raise ValueError(f"max_operand must be in 1..99, got {max_operand}")
        if not operators or set(operators) - set("+-*"):
            raise ValueError(f"operators must be some of '+-*', got {operators!r}")
        if reply_tokens < 1:
            raise ValueError(f"reply_tokens must be at least 1, got {reply_tokens}")
        self.agent = agent
        self.max_operand = max_operand
        self.operators = operators
        self.compact = compact
        self.call_reward = call_reward
        self.reply_tokens = reply_tokens
        self.answer_credit = answer_credit
        self.alphabet = alphabet(max_operand, operators)

    def _call(self, reply: ChatReply, call_id: str) -> ToolCall | ToolResult:
        """The calculator call in a first reply, or the error the tool answers a malformed one with."""
        if self.compact:
            return ToolCall(call_id, "calculator", {"expression": reply.raw_text})
        if reply.tool_error is not None or len(reply.tool_calls) != 1:
            answered = reply.written_calls[0].id if reply.written_calls else call_id
            error = reply.tool_error or "expected one calculator call"
            return ToolResult(answered, f"error: {error}", ok=False)
        return reply.tool_calls[0]

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        a, b = ctx.rng.randint(0, self.max_operand), ctx.rng.randint(0, self.max_operand)
        op = ctx.rng.choice(self.operators)
        expression = f"{a}{op}{b}"
        target = str(calculate(expression))
        agent = ctx.agent(self.agent)
        tok = agent.tokenizer
        allowed: list[int] | None = None
        if self.compact:  # the digits and signs an expression or its value can hold, and the end id
            allowed = [tok.token_id(c) for c in sorted(self.alphabet)]
            allowed += tok.stop_ids[:1]
        sampling: dict[str, Any] = {"max_new_tokens": self.reply_tokens, "allowed": allowed}
        tools = None if self.compact else [CALCULATOR]
        history: list[dict[str, Any]] = [{"role": "user", "content": f"compute {expression}"}]
        first = await agent.chat(history, tools=tools, **sampling)
        call = self._call(first, f"call_{ctx.index}")
        result = run_calculator(call) if isinstance(call, ToolCall) else call
        history += [first.message, result.message()]
        answer = await agent.chat(history, tools=tools, **sampling)
        right = answer.finish_reason == "stop" and answer.text.strip() == target
        # partial credit: the right number, but the model went on instead of ending its turn
        started = not right and answer.text.strip().startswith(target)
        call_ok = result.ok and result.content == target
        return Outcome(
            rewards={self.agent: float(right) + self.answer_credit * started},
            metadata={"success": float(right), "call_ok": float(call_ok)},
            turn_rewards={self.agent: [self.call_reward * call_ok, 0.0]},
        )
