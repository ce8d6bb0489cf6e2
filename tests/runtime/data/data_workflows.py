"""Workflows and reward functions for the data-driven driver tests (importable in Ray actors: the
test data folder is on their PYTHONPATH)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyrl_runtime.workflows.api import EpisodeContext, Outcome
from polyrl_runtime.workflows.prompts import PromptCompletion


class LoggedPrompt(PromptCompletion):
    """PromptCompletion that appends `<group> <row id>` to the file `log` after each episode."""

    def __init__(self, log: str, **args: Any) -> None:
        super().__init__(**args)
        self.log = log

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        out = await super().run_episode(ctx)
        assert ctx.sample is not None
        with open(self.log, "a") as f:
            f.write(f"{ctx.group_id} {ctx.sample['id']}\n")
        return out


def explode(completion: str, row: Mapping[str, Any]) -> float:
    raise ValueError(f"cannot score {row['id']}")
