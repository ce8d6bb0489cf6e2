"""Workflows of the league tests: a two-player game whose second player is drawn from the league."""

from __future__ import annotations

import asyncio
import string
from typing import Any

from polyrl_runtime.workflows.api import EpisodeContext, Workflow


class HigherDigit(Workflow):
    """The player and its rival (`ctx.opponent`: the latest version or a snapshot) each name a digit
    after the same prompt; the higher wins: 1 to the winner, 0 to the loser, 0.5 each on a tie."""

    def __init__(self, symbols: int = 4, rival: bool = True, **args: Any) -> None:
        super().__init__(**args)
        self.digits = list(string.digits[:symbols])
        self.rival = rival  # False: the rival is an agent of its own (no league opponent asked for)

    async def run_episode(self, ctx: EpisodeContext) -> dict[str, float]:
        player = ctx.agent("player")
        rival = ctx.opponent("rival") if self.rival else ctx.agent("rival")
        prompt = f"round:{ctx.rng.randrange(10)}"
        a, b = await asyncio.gather(
            player.generate(prompt, max_new_tokens=1, allowed=self.digits),
            rival.generate(prompt, max_new_tokens=1, allowed=self.digits),
        )
        x, y = int(a.text), int(b.text)
        won = 1.0 if x > y else 0.0 if x < y else 0.5
        return {"player": won, "rival": 1.0 - won}
