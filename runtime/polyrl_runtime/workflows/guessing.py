"""Independent guessing tasks, one per policy, played side by side in one episode (benchmarks).

Each agent sees a digit and must answer the digit `shift` places on (mod `symbols`); its reward is 1
when right. Agents do not interact: with N policies this is the same work as N single-policy jobs,
which is what `benchmarks/policy_scaling.py` compares.

With `reply_tokens` > 1 the reply is free-length: up to that many tokens drawn from the digits and
the model's end ids, so an agent must learn both the answer and to stop right after it: reward 1 for exactly the right
digit then an end id, 0.5 for a reply that starts with the right digit but goes on. With `chat: true` the task is asked through the
policy's chat template instead of as plain text.
"""

from __future__ import annotations

import asyncio
import string
from typing import Any

from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow


class Guessing(Workflow):
    def __init__(
        self,
        agents: list[str] | None = None,
        symbols: int = 4,
        shift: int = 1,
        chat: bool = False,
        reply_tokens: int = 1,
        **args: Any,
    ) -> None:
        super().__init__(**args)
        if not 2 <= symbols <= 10:
            raise ValueError(f"symbols must be in 2..10, got {symbols}")
        if reply_tokens < 1:
            raise ValueError(f"reply_tokens must be at least 1, got {reply_tokens}")
        self.agents = list(agents or ["agent"])
        self.digits = list(string.digits[:symbols])
        self.shift = shift
        self.chat = chat
        self.reply_tokens = reply_tokens

    async def _play(self, ctx: EpisodeContext, agent_name: str, digit: str) -> float:
        answer = self.digits[(self.digits.index(digit) + self.shift) % len(self.digits)]
        agent = ctx.agent(agent_name)
        task = f"see:{digit}"
        prompt = agent.chat_prompt([{"role": "user", "content": task}]) if self.chat else task
        if self.reply_tokens == 1:
            reply = await agent.generate(prompt, max_new_tokens=1, allowed=self.digits)
            return float(reply.text == answer)
        tok = agent.tokenizer
        allowed = [*(tok.token_id(d) for d in self.digits), *tok.stop_ids[:1]]
        reply = await agent.generate(prompt, max_new_tokens=self.reply_tokens, allowed=allowed)
        if reply.finish_reason == "stop" and reply.text == answer:
            return 1.0
        return 0.5 if reply.text.startswith(answer) else 0.0  # the right answer, but not ended there

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        digit = ctx.rng.choice(self.digits)
        rewards = await asyncio.gather(*(self._play(ctx, a, digit) for a in self.agents))
        exact = sum(r == 1.0 for r in rewards) / len(rewards)  # partial credit is not success
        return Outcome(dict(zip(self.agents, rewards, strict=True)), {"success": exact})
