"""Independent guessing tasks, one per policy, played side by side in one episode (benchmarks).

Each agent sees a digit and must answer the digit `shift` places on (mod `symbols`); its reward is 1
when right. Agents do not interact: with N policies this is the same work as N single-policy jobs,
which is what `benchmarks/policy_scaling.py` compares.
"""

from __future__ import annotations

import asyncio
import string
from typing import Any

from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow


class Guessing(Workflow):
    def __init__(
        self, agents: list[str] | None = None, symbols: int = 4, shift: int = 1, **args: Any
    ) -> None:
        super().__init__(**args)
        self.agents = list(agents or ["agent"])
        self.digits = list(string.digits[:symbols])
        self.shift = shift

    async def _play(self, ctx: EpisodeContext, agent: str, digit: str) -> float:
        reply = await ctx.agent(agent).generate(f"see:{digit}", max_new_tokens=1, allowed=self.digits)
        return float(reply.text == self.digits[(self.digits.index(digit) + self.shift) % len(self.digits)])

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        digit = ctx.rng.choice(self.digits)
        rewards = await asyncio.gather(*(self._play(ctx, a, digit) for a in self.agents))
        return Outcome(dict(zip(self.agents, rewards, strict=True)), {"success": sum(rewards) / len(rewards)})
