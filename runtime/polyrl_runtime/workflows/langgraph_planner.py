"""A LangGraph program of two agents, two policies, trained unchanged: a planner writes a plan, a
solver answers with it, each a LangChain `ChatOpenAI` model of the episode's one OpenAI endpoint
(workflows/openai_server.py), told apart by `model`.

    llm = ChatOpenAI(model="planner", base_url=await ctx.openai_base_url(), api_key="polyrl")

The graph is `START -> plan -> solve -> END` over a state of messages. Each node's call is its agent's
chat call, a training sequence of its policy. Reward, to both: 1 when the solver's last number is the
answer, else 0. Needs the `agents` extra.
"""

from __future__ import annotations

import re
from typing import Any, TypedDict

from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow

PLANNER = "Write a one-line plan for answering the question. Do not answer it."
SOLVER = "Follow the plan and reply with the number only."


class _State(TypedDict):
    question: str
    plan: str
    answer: str


class LangGraphPlannerSolver(Workflow):
    """`a op b` questions: the planner agent plans, the solver agent answers."""

    def __init__(self, *, max_operand: int = 9, max_tokens: int = 32, **args: Any) -> None:
        super().__init__(**args)
        self.max_operand, self.max_tokens = max_operand, max_tokens

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        from langchain_core.messages import HumanMessage, SystemMessage
        from langchain_openai import ChatOpenAI
        from langgraph.graph import END, START, StateGraph

        a, b = ctx.rng.randint(0, self.max_operand), ctx.rng.randint(0, self.max_operand)
        url = await ctx.openai_base_url("planner", "solver")

        def llm(agent: str) -> ChatOpenAI:
            return ChatOpenAI(
                model=agent, base_url=url, api_key="polyrl", max_retries=0, max_tokens=self.max_tokens
            )

        planner, solver = llm("planner"), llm("solver")

        async def plan(state: _State) -> dict[str, str]:
            reply = await planner.ainvoke([SystemMessage(PLANNER), HumanMessage(state["question"])])
            return {"plan": str(reply.content)}

        async def solve(state: _State) -> dict[str, str]:
            prompt = f"{state['question']}\nPlan: {state['plan']}"
            reply = await solver.ainvoke([SystemMessage(SOLVER), HumanMessage(prompt)])
            return {"answer": str(reply.content)}

        graph = StateGraph(_State)
        graph.add_node("plan", plan)
        graph.add_node("solve", solve)
        graph.add_edge(START, "plan")
        graph.add_edge("plan", "solve")
        graph.add_edge("solve", END)
        final = await graph.compile().ainvoke({"question": f"What is {a}+{b}?", "plan": "", "answer": ""})
        numbers = re.findall(r"-?\d+", final["answer"])
        right = bool(numbers) and int(numbers[-1]) == a + b
        reward = 1.0 if right else 0.0
        return Outcome({"planner": reward, "solver": reward}, metadata={"success": float(right)})
