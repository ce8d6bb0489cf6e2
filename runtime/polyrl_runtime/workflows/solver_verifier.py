"""A solver and a verifier on sums, two policies trained in one job.

    solver:    1+2=  3
    verifier:  user: 1+2=3?
               assistant: y

The solver answers with one digit and is rewarded 1 for the right sum; the verifier, through its
policy's chat template (`agent.chat`), judges an answer to the same sum with `y` or `n` and is
rewarded 1 for a correct judgement. Each reply is constrained to the tokens it may use (`allowed`),
so a randomly initialised model (`builtin://tiny-qwen2`) starts at chance (1 in `2 * max_operand + 1`
for the solver, 1 in 2 for the verifier) and RL alone has to teach it the task.

What the verifier judges (`contrast`): the solver's answer, or, in a `contrast` share of the episodes
(drawn per episode), an answer of the other kind: the right sum when the solver was wrong, a wrong
digit when it was right. At 0.5 half of what it judges is right whatever the solver's accuracy.
Shown only the solver's answers (`contrast: 0`), the verifier sees mostly wrong answers while the
solver learns and mostly right ones after: a verifier that always says `n`, then always `y`, earns
the majority's share without checking anything, and that is what RL finds, with full weights as
with adapters (docs/workflows.md). Balanced, always answering one way earns 0.5, and any reward
above it is checking.

Both agents are shown the sum alone (`a+b=`): a random two-layer model asked a whole word problem
collapses to the most frequent answer (its numbers sit far from where it answers).

The problems are generated in code from the group's seed (`ctx.rng`): every episode of a GRPO group
gets the same sum, which is what group-relative advantages compare, and the job needs no data file.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def sum(self) -> str:
        return f"{self.a}+{self.b}="


def verifier_question(problem: Problem, shown: str) -> str:
    """The verifier's user message: is `shown` the answer to `problem`?"""
    return f"{problem.sum}{shown}?"


def judge_reward(verdict: str, claimed: str, answer: int) -> float:
    """The verifier's reward: 1 when `verdict` ('y' or 'n') says rightly whether `claimed` is `answer`."""
    correct = claimed.strip() == str(answer)
    return float(verdict.strip() == ("y" if correct else "n"))


def contrast_rng(seed: int, index: int) -> random.Random:
    """The draws of episode `index` of group `seed` that decide what its verifier judges: the
    episode's own seed, not the group's, so one group's members judge both kinds."""
    return random.Random(f"{seed}/{index}/contrast")


def shown_answer(
    claimed: str, answer: int, digits: list[str], contrast: float, *, seed: int, index: int
) -> tuple[str, bool]:
    """What the verifier of episode `index` of group `seed` judges, and whether it is a contrasting
    answer: `claimed`, or with probability `contrast` one of the other kind (the right answer when
    `claimed` is wrong, else one of the wrong `digits`). Drawn from the episode's own seed, not the
    group's, so one group's members judge both kinds."""
    own = contrast_rng(seed, index)
    if own.random() >= contrast:
        return claimed, False
    if claimed.strip() != str(answer):
        return str(answer), True
    return own.choice([d for d in digits if d != str(answer)]), True


class SolverVerifier(Workflow):
    def __init__(
        self,
        *,
        solver: str = "solver",
        verifier: str = "verifier",
        max_operand: int = 2,
        contrast: float = 0.5,
        **args: Any,
    ) -> None:
        super().__init__(**args)
        if not 1 <= max_operand <= 4:
            raise ValueError(f"max_operand must be in 1..4 (sums stay one digit), got {max_operand}")
        if not 0.0 <= contrast <= 1.0:
            raise ValueError(f"contrast must be in 0..1 (a share of the episodes), got {contrast}")
        if solver == verifier:
            raise ValueError(f"solver and verifier must be different agents, both are {solver!r}")
        self.solver = solver
        self.verifier = verifier
        self.max_operand = max_operand
        self.contrast = contrast
        self.digits = [str(d) for d in range(2 * max_operand + 1)]

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        rng = ctx.rng
        problem = Problem(rng.randint(0, self.max_operand), rng.randint(0, self.max_operand))
        solved = await ctx.agent(self.solver).generate(problem.sum, max_new_tokens=1, allowed=self.digits)
        claimed = solved.text.strip()
        shown, contrasted = shown_answer(
            claimed, problem.answer, self.digits, self.contrast, seed=ctx.seed, index=ctx.index
        )
        judged = await ctx.agent(self.verifier).chat(
            [{"role": "user", "content": verifier_question(problem, shown)}],
            max_new_tokens=1,
            allowed=["y", "n"],
        )
        solver_reward = float(claimed == str(problem.answer))
        verifier_reward = judge_reward(judged.text, shown, problem.answer)
        return Outcome(
            rewards={self.solver: solver_reward, self.verifier: verifier_reward},
            metadata={
                "success": solver_reward,
                "verifier_accuracy": verifier_reward,
                "verifier_shown_solver": float(not contrasted),
            },
        )
