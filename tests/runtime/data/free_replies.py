"""A workflow with free multi-token replies of varying length (tests of sampling under batching).

Each agent answers `see:D` with up to `max_new_tokens` unconstrained tokens and is rewarded when its
reply contains the digit after D. Replies end at EOS or at the token limit, so requests join and leave
an engine's running batch at times that depend on scheduling.
"""

from __future__ import annotations

import string
from typing import Any

from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow


class FreeReplies(Workflow):
    def __init__(self, max_new_tokens: int = 12, turns: int = 2, **args: Any) -> None:
        super().__init__(**args)
        self.max_new_tokens = max_new_tokens
        self.turns = turns

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        digit = ctx.rng.choice(string.digits[:4])
        answer = str((int(digit) + 1) % 4)
        reward = 0.0
        for _ in range(self.turns):
            reply = await ctx.agent("agent").generate(f"see:{digit}", max_new_tokens=self.max_new_tokens)
            reward += float(answer in reply.text) / self.turns
        return Outcome({"agent": reward}, {"success": reward})
