"""A generic single-turn workflow for data-driven jobs: no workflow code needed.

Each group plays one row of `spec.data.train`: the agent answers the row's `prompt` (plain text) or
`messages` (a chat, rendered with the policy's chat template) and is rewarded by a reward function
(a built-in name or `module:attr`, rewards/) that compares the completion with the row's `answer`.

    workflow:
      entrypoint: polyrl_runtime.workflows.prompts:PromptCompletion
      args: {reward: math, agent: solver}
"""

from __future__ import annotations

from typing import Any

from polyrl_runtime.rewards.load import load_reward
from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow


class PromptCompletion(Workflow):
    def __init__(
        self, reward: str = "exact_match", agent: str = "agent", max_new_tokens: int | None = None
    ) -> None:
        super().__init__()
        load_reward(reward)  # a bad name fails the job at start, not every episode
        self.reward, self.agent, self.max_new_tokens = reward, agent, max_new_tokens

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        row = ctx.sample
        if row is None:
            raise ValueError("PromptCompletion plays rows of spec.data.train, and the job has no spec.data")
        agent = ctx.agent(self.agent)
        # A row with neither field: the KeyError names the file, the row index and the row's fields.
        prompt: Any = agent.chat_prompt(row["messages"]) if "messages" in row else str(row["prompt"])
        reply = await agent.generate(prompt, max_new_tokens=self.max_new_tokens)
        r = ctx.reward(self.reward, reply.text)
        return Outcome({self.agent: r}, {"success": r})
