"""An OpenAI Agents SDK agent trained unchanged: a calculator-using agent built with `openai-agents`,
run by the SDK's own `Runner` against the episode's OpenAI endpoint (workflows/openai_server.py).

    Agent(name=..., instructions=..., tools=[calculator], model=OpenAIChatCompletionsModel(
        model="solver", openai_client=AsyncOpenAI(base_url=await ctx.openai_base_url("solver"))))

The SDK sends each step of its loop (the question, then the question with the call and the tool's
output) as a chat completion; polyrl answers each as the agent's chat call, so the whole run is one
conversation, one training sequence. Reward: 1 when the final output is the right number, else 0.
Needs the `agents` extra (`pip install 'polyrl-runtime[agents]'`); the SDK's tracing, which would
export to OpenAI, is switched off.
"""

from __future__ import annotations

import re
from typing import Any

from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow
from polyrl_runtime.workflows.tools import calculate

INSTRUCTIONS = "Answer the arithmetic question. Use the calculator tool, then reply with the number only."


class AgentsSdkCalculator(Workflow):
    """`a op b` questions answered by an Agents SDK agent with a calculator tool."""

    def __init__(
        self, *, agent: str = "solver", max_operand: int = 9, max_turns: int = 4, **args: Any
    ) -> None:
        super().__init__(**args)
        self.agent, self.max_operand, self.max_turns = agent, max_operand, max_turns

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        import agents
        import openai

        agents.set_tracing_disabled(True)
        a, b = ctx.rng.randint(0, self.max_operand), ctx.rng.randint(0, self.max_operand)
        question, answer = f"What is {a}+{b}?", a + b

        @agents.function_tool
        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression of integers with + - * and parentheses."""
            try:
                return str(calculate(expression))
            except ValueError as e:
                return f"error: {e}"

        client = openai.AsyncOpenAI(
            base_url=await ctx.openai_base_url(self.agent), api_key="polyrl", max_retries=0
        )
        model = agents.OpenAIChatCompletionsModel(model=self.agent, openai_client=client)
        sdk_agent = agents.Agent(name=self.agent, instructions=INSTRUCTIONS, tools=[calculator], model=model)
        try:
            result = await agents.Runner.run(sdk_agent, question, max_turns=self.max_turns)
            output = str(result.final_output)
        except agents.MaxTurnsExceeded:
            output = ""
        finally:
            await client.close()
        numbers = re.findall(r"-?\d+", output)
        right = bool(numbers) and int(numbers[-1]) == answer
        return Outcome({self.agent: 1.0 if right else 0.0}, metadata={"success": float(right)})
