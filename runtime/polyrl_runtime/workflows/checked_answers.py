"""A solver and a verifier on the rows of `spec.data.train`, for pretrained instruct models.

    solver:    user: What is 7 + 5?            assistant: 7 + 5 = 12
    verifier:  user: Question: What is 7 + 5?
                     Proposed answer: 12
                     Is the proposed answer correct? Reply yes or no.
               assistant: yes

The solver answers the row's `prompt` through its chat template and is rewarded by the job's reward
function (`reward`, on the part of the reply `extract` names: workflows/prompts.py). The verifier
judges an answer to the same question with one token, `verdicts` (default `[yes, no]`: each must be
one token of the verifier's tokenizer), and is rewarded 1 for a correct judgement; whether an answer
is correct is what the reward function says of it.

What the verifier judges (`contrast`, as in solver_verifier.py): the solver's extracted answer, or,
in a `contrast` share of the episodes, one of the other kind: the row's answer when the solver was
wrong, a wrong number near it (the answer plus or minus 1 or 2) when the solver was right. At 0.5
half of what it judges is right whatever the solver's accuracy, so a verifier that always says one
word earns 0.5, and anything above it is checking. Contrasting needs numeric answers; a row whose
answer is not a number fails its episode, naming it.

    workflow:
      entrypoint: polyrl_runtime.workflows.checked_answers:CheckedAnswers
      args: {reward: reasoning_gym, extract: last_number, max_new_tokens: 32}
"""

from __future__ import annotations

import random
from typing import Any

from polyrl_runtime.rewards.load import load_reward
from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow
from polyrl_runtime.workflows.prompts import EXTRACTORS
from polyrl_runtime.workflows.solver_verifier import contrast_rng


def verifier_message(question: str, shown: str, verdicts: tuple[str, str] = ("yes", "no")) -> str:
    """The verifier's user message: is `shown` the answer to `question`?"""
    return (
        f"Question: {question}\nProposed answer: {shown or '(none)'}\n"
        f"Is the proposed answer correct? Reply {verdicts[0]} or {verdicts[1]}."
    )


def wrong_near(answer: Any, rng: random.Random, *, episode: str) -> str:
    """A wrong number near the numeric `answer` (answer + one of -2, -1, 1, 2)."""
    try:
        value = float(str(answer))
    except ValueError:
        raise ValueError(
            f"episode {episode}: CheckedAnswers contrasts numeric answers only, and the row's answer is "
            f"{answer!r} (set workflow.args.contrast to 0 for this data)"
        ) from None
    wrong = value + rng.choice((-2, -1, 1, 2))
    return str(int(wrong)) if wrong.is_integer() else repr(wrong)


class CheckedAnswers(Workflow):
    def __init__(
        self,
        *,
        reward: str = "exact_match",
        extract: str = "reply",
        solver: str = "solver",
        verifier: str = "verifier",
        contrast: float = 0.5,
        verdicts: tuple[str, str] | list[str] = ("yes", "no"),
        max_new_tokens: int | None = None,
        **args: Any,
    ) -> None:
        super().__init__(**args)
        load_reward(reward)  # a bad name fails the job at start, not every episode
        if extract not in EXTRACTORS:
            raise ValueError(f"workflow.args.extract {extract!r}: expected one of {', '.join(EXTRACTORS)}")
        if not 0.0 <= contrast <= 1.0:
            raise ValueError(
                f"workflow.args.contrast must be in 0..1 (a share of the episodes), got {contrast}"
            )
        if solver == verifier:
            raise ValueError(
                f"workflow.args: solver and verifier must be different agents, both are {solver!r}"
            )
        if len(verdicts) != 2 or verdicts[0] == verdicts[1] or not all(v.strip() for v in verdicts):
            raise ValueError(
                f"workflow.args.verdicts must be two different words (accept, reject), got {list(verdicts)}"
            )
        self.reward, self.extract = reward, EXTRACTORS[extract]
        self.verdicts = (str(verdicts[0]), str(verdicts[1]))
        self.solver, self.verifier = solver, verifier
        self.contrast, self.max_new_tokens = contrast, max_new_tokens

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        row = ctx.sample
        if row is None:
            raise ValueError("CheckedAnswers plays rows of spec.data.train, and the job has no spec.data")
        question = str(row["prompt"])
        solved = await ctx.agent(self.solver).chat(
            [{"role": "user", "content": question}], max_new_tokens=self.max_new_tokens
        )
        claimed = self.extract(solved.text)
        solver_reward = ctx.reward(self.reward, claimed)
        own = contrast_rng(ctx.seed, ctx.index)
        contrasted = own.random() < self.contrast
        shown = claimed
        if contrasted:
            shown = (
                str(row["answer"])
                if solver_reward < 1.0
                else wrong_near(row["answer"], own, episode=ctx.episode_id)
            )
        correct = ctx.reward(self.reward, shown) >= 1.0
        judged = await ctx.agent(self.verifier).chat(
            [{"role": "user", "content": verifier_message(question, shown, self.verdicts)}],
            max_new_tokens=1,
            allowed=list(self.verdicts),
        )
        verifier_reward = float((judged.text.strip() == self.verdicts[0]) == correct)
        return Outcome(
            rewards={self.solver: solver_reward, self.verifier: verifier_reward},
            metadata={
                "success": solver_reward,
                "verifier_accuracy": verifier_reward,
                "verifier_shown_solver": float(not contrasted),
            },
        )
