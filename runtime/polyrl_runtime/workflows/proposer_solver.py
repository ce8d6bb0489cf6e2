"""Proposer/solver: a mixed-motive two-policy game where each side's reward depends on the other.

The proposer writes an addition problem `x+y` (two digits below `base`); the solver answers
(x + y) mod `base` with one digit. The solver earns 1 for a right answer. The proposer's reward:
  * mode `competitive`: 1 when the solver is wrong (zero-sum, adversarial curriculum);
  * mode `mixed` (default): 1 when the solver is right on a problem with no zero operand, so the
    proposer is pushed to pose non-trivial problems the solver can actually learn from.
"""

from __future__ import annotations

import string
from typing import Any, Literal

from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow


class ProposerSolver(Workflow):
    def __init__(self, base: int = 5, mode: Literal["mixed", "competitive"] = "mixed", **args: Any) -> None:
        super().__init__(**args)
        if not 2 <= base <= 10:
            raise ValueError(f"base must be in 2..10, got {base}")
        if mode not in ("mixed", "competitive"):
            raise ValueError(f"mode must be mixed or competitive, got {mode!r}")
        self.digits = list(string.digits[:base])
        self.base = base
        self.mode = mode

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        seed_digit = ctx.rng.choice(self.digits)  # the group's shared context: a style hint
        problem = await ctx.agent("proposer").generate(
            f"pose:{seed_digit}", max_new_tokens=2, allowed=self.digits
        )
        x, y = (int(c) for c in problem.text)
        answer = await ctx.agent("solver").generate(f"{x}+{y}=", max_new_tokens=1, allowed=self.digits)
        correct = float(int(answer.text) == (x + y) % self.base)
        nontrivial = float(x != 0 and y != 0)
        proposer = 1.0 - correct if self.mode == "competitive" else correct * nontrivial
        return Outcome(
            {"proposer": proposer, "solver": correct},
            {"problem": f"{x}+{y}", "answer": answer.text, "success": correct},
        )
