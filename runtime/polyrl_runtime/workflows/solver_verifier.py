"""A solver and a verifier on arithmetic word problems, two policies trained in one job.

    solver:    1+2=  3
    verifier:  user: Ann has 1 apples and gets 2 more. How many apples?
                     1+2=3?
               assistant: y

The solver answers with one digit and is rewarded 1 for the right sum; the verifier, through its
policy's chat template (`agent.chat`), judges the solver's answer with `y` or `n` and is rewarded 1
for a correct judgement, whichever way the solver did. Each reply is constrained to the tokens it
may use (`allowed`), so a randomly initialised model (`builtin://tiny-qwen2`) starts at chance (1 in
`2 * max_operand + 1` for the solver, 1 in 2 for the verifier) and RL alone has to teach it the task.

The problem's sum (`a+b=`) ends what each agent is shown: a random two-layer model asked the bare
word problem collapses to the most frequent answer (its numbers sit far from where it answers),
while the short form learns within a minute or two (docs/performance.md). The verifier's rewards
move with the solver: while the solver is mostly wrong, `n` pays; as the solver learns, the verifier
must learn to check, and its reward dips before it rises.

The problems are generated in code from the group's seed (`ctx.rng`): every episode of a GRPO group
gets the same problem, which is what group-relative advantages compare, and the job needs no data
file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    text: str  # the word problem

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def sum(self) -> str:
        return f"{self.a}+{self.b}="


def make_problem(a: int, b: int) -> Problem:
    """The word problem `a + b`."""
    return Problem(a, b, f"Ann has {a} apples and gets {b} more. How many apples?")


def judge_reward(verdict: str, claimed: str, answer: int) -> float:
    """The verifier's reward: 1 when `verdict` ('y' or 'n') says rightly whether `claimed` is `answer`."""
    correct = claimed.strip() == str(answer)
    return float(verdict.strip() == ("y" if correct else "n"))


class SolverVerifier(Workflow):
    def __init__(
        self,
        *,
        solver: str = "solver",
        verifier: str = "verifier",
        max_operand: int = 2,
        **args: Any,
    ) -> None:
        super().__init__(**args)
        if not 1 <= max_operand <= 4:
            raise ValueError(f"max_operand must be in 1..4 (sums stay one digit), got {max_operand}")
        if solver == verifier:
            raise ValueError(f"solver and verifier must be different agents, both are {solver!r}")
        self.solver = solver
        self.verifier = verifier
        self.max_operand = max_operand
        self.digits = [str(d) for d in range(2 * max_operand + 1)]

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        rng = ctx.rng
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        problem = make_problem(a, b)
        solver = ctx.agent(self.solver)
        solved = await solver.generate(problem.sum, max_new_tokens=1, allowed=self.digits)
        claimed = solved.text.strip()
        verifier = ctx.agent(self.verifier)
        question = f"{problem.text}\n{problem.sum}{claimed}?"
        judged = await verifier.chat(
            [{"role": "user", "content": question}], max_new_tokens=1, allowed=["y", "n"]
        )
        solver_reward = float(claimed == str(problem.answer))
        verifier_reward = judge_reward(judged.text, claimed, problem.answer)
        return Outcome(
            rewards={self.solver: solver_reward, self.verifier: verifier_reward},
            metadata={"success": solver_reward, "verifier_accuracy": verifier_reward},
        )
