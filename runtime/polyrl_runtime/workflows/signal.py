"""Cooperative speaker/listener signalling game (Lewis): two policies must invent a shared code.

The speaker sees a target symbol and sends a message of `length` tokens drawn from `vocab` letters;
the listener sees only the message and guesses the symbol. Both get reward 1 when the guess is right,
else 0, so success starts at about 1/symbols (the listener guesses blindly) and reaches 1 only when
both policies agree on a code: neither can learn it alone.
"""

from __future__ import annotations

import asyncio
import random
import string
from typing import Any

from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow

LETTERS = string.ascii_lowercase
DIGITS = string.digits


class SignalGame(Workflow):
    def __init__(
        self,
        vocab: int = 8,
        symbols: int = 4,
        length: int = 1,
        tail_tokens: int = 0,
        tail_alpha: float = 1.2,
        *,
        latency_s: float = 0.0,
        **args: Any,
    ) -> None:
        super().__init__(**args)
        if not 2 <= symbols <= len(DIGITS):
            raise ValueError(f"symbols must be in 2..{len(DIGITS)}, got {symbols}")
        if not 2 <= vocab <= len(LETTERS):
            raise ValueError(f"vocab must be in 2..{len(LETTERS)}, got {vocab}")
        if vocab**length < symbols:
            raise ValueError(f"vocab**length ({vocab}**{length}) must be at least symbols ({symbols})")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        self.symbols = list(DIGITS[:symbols])
        self.letters = list(LETTERS[:vocab])
        self.length = length
        # Long-tail mode (benchmarks): after answering, the listener keeps "talking" for a Pareto-
        # distributed number of tokens (at most tail_tokens): a few episodes take far longer.
        self.tail_tokens = tail_tokens
        self.tail_alpha = tail_alpha
        # Seconds each episode waits on its environment (a tool call, a simulator) before it is
        # scored, without using CPU: episodes overlap as they do with real environments. Tests use
        # it to keep a job running for a known minimum time while they act on it.
        self.latency_s = latency_s

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        target = ctx.rng.choice(self.symbols)
        # The informative token comes last in each prompt: the reply is generated right after it.
        message = await ctx.agent("speaker").generate(
            f"target:{target}", max_new_tokens=self.length, allowed=self.letters
        )
        guess = await ctx.agent("listener").generate(
            f"message:{message.text}", max_new_tokens=1, allowed=self.symbols
        )
        if self.tail_tokens:
            own = random.Random(ctx.episode_id)  # per episode, unlike ctx.rng (shared by the group)
            extra = min(self.tail_tokens, int(own.paretovariate(self.tail_alpha)))
            # The listener then rambles: generation time (a long tail of episode lengths) without
            # learning noise (one allowed token: its logprob is 0 and has no gradient).
            await ctx.agent("listener").generate(f"guess:{guess.text}", max_new_tokens=extra, allowed=["."])
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        success = float(guess.text == target)
        return Outcome(
            {"speaker": success, "listener": success},
            {"target": target, "message": message.text, "guess": guess.text, "success": success},
        )
