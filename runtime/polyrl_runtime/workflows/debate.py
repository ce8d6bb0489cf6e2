"""Debate: three policies argue over a question, multi-turn (the GPU example `debate-gpu.yaml`).

A proposer answers, a critic critiques the answer, the proposer revises (for `rounds` rounds in all),
then a judge says whether the final answer is right (`y`/`n`). Rewards: the proposer and the critic
get 1 when the final answer is right (the critic's job is to get it fixed); the judge gets 1 when its
verdict matches the truth. Questions come from `dataset` (JSON lines with `question` and `answer`,
a file:// or mounted pvc:// path) or, without one, from built-in arithmetic. Pieces of text fed back
into prompts are cut to `max_chars`, so prompts stay within small models' context.
"""

from __future__ import annotations

import json
import re
from typing import Any

from polyrl_runtime.models import local_path
from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow


def _numbers(text: str) -> str:
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else ""


class Debate(Workflow):
    def __init__(self, rounds: int = 2, dataset: str | None = None, max_chars: int = 24, **args: Any) -> None:
        super().__init__(**args)
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.rounds = rounds
        self.max_chars = max_chars
        self.items: list[tuple[str, str]] = []
        if dataset:
            path = local_path(dataset)
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    row = json.loads(line)
                    if "question" not in row or "answer" not in row:
                        raise ValueError(f"{path}:{n}: each line needs 'question' and 'answer'")
                    self.items.append((str(row["question"]), str(row["answer"])))
            if not self.items:
                raise ValueError(f"{path}: no questions")

    def _question(self, ctx: EpisodeContext) -> tuple[str, str]:
        if self.items:
            return ctx.rng.choice(self.items)
        a, b = ctx.rng.randrange(10), ctx.rng.randrange(10)
        return f"{a}+{b}", str(a + b)

    def _cut(self, text: str) -> str:
        return text.strip()[: self.max_chars]

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        question, truth = self._question(ctx)
        proposer, critic, judge = ctx.agent("proposer"), ctx.agent("critic"), ctx.agent("judge")
        answer = self._cut((await proposer.generate(f"q:{question} a:")).text)
        first_right = _numbers(answer) == truth
        for _ in range(self.rounds - 1):
            critique = self._cut((await critic.generate(f"q:{question} a:{answer} critique:")).text)
            answer = self._cut((await proposer.generate(f"q:{question} a:{answer} c:{critique} a:")).text)
        right = _numbers(answer) == truth
        verdict = (
            await judge.generate(f"q:{question} a:{answer} ok?", max_new_tokens=1, allowed=["y", "n"])
        ).text
        r = float(right)
        return Outcome(
            {"proposer": r, "critic": r, "judge": float((verdict == "y") == right)},
            {"success": r, "first_right": first_right, "answer": answer, "truth": truth},
        )
