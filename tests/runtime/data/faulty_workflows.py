"""Workflows that misbehave on purpose (imported by Ray workers through PYTHONPATH in the tests)."""

from __future__ import annotations

import random
from typing import Any

from polyrl_runtime.workflows.api import EpisodeContext
from polyrl_runtime.workflows.failure import PolicyFailure
from polyrl_runtime.workflows.signal import SignalGame


class AlwaysFails(SignalGame):
    async def run_episode(self, ctx: EpisodeContext) -> Any:
        await ctx.agent("speaker").generate("target:1", max_new_tokens=1, allowed=["a"])
        raise ZeroDivisionError("reward function divided by zero")


class SometimesFails(SignalGame):
    async def run_episode(self, ctx: EpisodeContext) -> Any:
        if ctx.index == 0:
            raise RuntimeError("flaky environment")
        return await super().run_episode(ctx)


class FailsAFraction(SignalGame):
    """Fails about a quarter of the episodes, at the end (after the agents' turns: work done and
    lost), a different member of each group each time, some groups not at all and some twice."""

    async def run_episode(self, ctx: EpisodeContext) -> Any:
        outcome = await super().run_episode(ctx)
        if random.Random(ctx.seed * 7919 + ctx.index).random() < 0.25:
            raise RuntimeError(f"flaky environment (episode {ctx.episode_id})")
        return outcome


class PolicyFailsAFraction(SignalGame):
    """Like FailsAFraction, but what fails is the policies' output (PolicyFailure): those episodes
    are trained on with the failure reward instead of being replaced."""

    async def run_episode(self, ctx: EpisodeContext) -> Any:
        outcome = await super().run_episode(ctx)
        if random.Random(ctx.seed * 7919 + ctx.index).random() < 0.25:
            raise PolicyFailure(f"unusable output (episode {ctx.episode_id})")
        return outcome


class AlwaysTied(SignalGame):
    """Every episode of a group gets the same reward: no group carries a learning signal (what
    dynamic sampling drops, up to its cap)."""

    async def run_episode(self, ctx: EpisodeContext) -> Any:
        await super().run_episode(ctx)
        return {"speaker": 1.0, "listener": 1.0}


class Rambles(SignalGame):
    """The speaker writes letters (no end token allowed) up to the model's context, again and again:
    an episode that always outlasts workflow.episodeTimeoutSeconds, a request generating when it
    does."""

    async def run_episode(self, ctx: EpisodeContext) -> Any:
        while True:
            await ctx.agent("speaker").generate("target:1", max_new_tokens=100_000, allowed=["a", "b"])
