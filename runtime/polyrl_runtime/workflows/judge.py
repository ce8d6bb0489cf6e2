"""LLM-as-judge rewards: a reply is scored by asking a judge policy, usually a frozen one
(`frozen: true`: served, never trained), whether it is right.

    workflow:
      entrypoint: polyrl_runtime.workflows.prompts:PromptCompletion
      args:
        agent: solver
        judge: {agent: judge, verdicts: {"yes": 1.0, "no": 0.0}}
        policies: {solver: solver, judge: judge}

The judge sees `template` filled with the row's question (`{question}`), the reply's extracted
answer (`{answer}`) and the row's reference answer (`{reference}`, "(none)" for a row without one),
as one user message through its chat template (`chat`, default true) or as plain text. It answers
with one of the `verdicts` words, each worth its reward:
- `constrained` (default true): one token, sampled among the verdict words only (each must be one
  token of the judge's tokenizer), so every reply is a verdict;
- otherwise a free reply of up to `max_new_tokens`, whose last verdict word (case-insensitive, as a
  whole word) is the verdict. A reply without one fails the episode with a `JudgeError`, counted as
  `judge_error` and never trained on: the solver did nothing wrong.

The judge's own turns carry reward 0: a frozen judge's are dropped by the buffer (`policy_frozen`);
a judge policy that is trained would learn nothing from them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polyrl_runtime.workflows.api import EpisodeContext

DEFAULT_TEMPLATE = (
    "Question: {question}\nReference answer: {reference}\nProposed answer: {answer}\n"
    "Is the proposed answer correct? Reply {verdict_words}."
)
_FIELDS = frozenset({"agent", "template", "verdicts", "constrained", "chat", "max_new_tokens"})


class JudgeError(Exception):
    """The judge policy's reply holds no verdict: the episode is dropped (judge_error)."""


@dataclass(frozen=True)
class Judge:
    agent: str = "judge"
    template: str = DEFAULT_TEMPLATE
    verdicts: Mapping[str, float] = field(default_factory=lambda: {"yes": 1.0, "no": 0.0})
    constrained: bool = True
    chat: bool = True
    max_new_tokens: int = 16

    @classmethod
    def parse(cls, arg: Mapping[str, Any]) -> Judge:
        """`workflow.args.judge` checked; a ValueError names the field that is wrong."""
        if not isinstance(arg, Mapping):
            raise ValueError(f"workflow.args.judge must be a mapping, got {arg!r}")
        unknown = set(arg) - _FIELDS
        if unknown:
            raise ValueError(
                f"workflow.args.judge: unknown fields {sorted(unknown)} (known: {sorted(_FIELDS)})"
            )
        judge = cls(**{k: v for k, v in arg.items() if k != "verdicts"})
        verdicts = arg.get("verdicts", judge.verdicts)
        if not isinstance(verdicts, Mapping) or len(verdicts) < 2:
            raise ValueError(
                "workflow.args.judge.verdicts must map at least two words to rewards, e.g. "
                f"{{yes: 1.0, no: 0.0}}, got {verdicts!r}"
            )
        words = {str(w).strip(): float(r) for w, r in verdicts.items()}
        if len(words) != len(verdicts) or not all(words) or any(re.search(r"\s", w) for w in words):
            raise ValueError(
                f"workflow.args.judge.verdicts must be distinct single words, got {list(verdicts)}"
            )
        if "{answer}" not in judge.template:
            raise ValueError(
                "workflow.args.judge.template must contain {answer}: the judge must see the reply"
            )
        if not isinstance(judge.max_new_tokens, int) or judge.max_new_tokens < 1:
            raise ValueError(f"workflow.args.judge.max_new_tokens must be >= 1, got {judge.max_new_tokens!r}")
        return cls(
            judge.agent,
            judge.template,
            words,
            bool(judge.constrained),
            bool(judge.chat),
            judge.max_new_tokens,
        )

    def message(self, question: str, answer: str, reference: str | None) -> str:
        words = list(self.verdicts)
        return self.template.format(
            question=question,
            answer=answer or "(none)",
            reference="(none)" if reference is None else reference,
            verdict_words=", ".join(words[:-1]) + " or " + words[-1],
        )

    def verdict(self, reply: str, *, episode: str) -> str:
        """The verdict word of a reply: the last verdict word it contains."""
        found = [
            m.group(0).lower()
            for m in re.finditer(r"\b(" + "|".join(re.escape(w) for w in self.verdicts) + r")\b", reply, re.I)
        ]
        by_lower = {w.lower(): w for w in self.verdicts}
        if not found:
            raise JudgeError(
                f"episode {episode}: judge agent {self.agent!r} replied {reply[:200]!r}, which holds none "
                f"of the verdicts {list(self.verdicts)}"
            )
        return by_lower[found[-1]]

    async def score(self, ctx: EpisodeContext, *, question: str, answer: str, reference: str | None) -> float:
        """Ask the judge about `answer`; the reward of its verdict."""
        agent = ctx.agent(self.agent)
        text = self.message(question, answer, reference)
        allowed = list(self.verdicts) if self.constrained else None
        max_new = 1 if self.constrained else self.max_new_tokens
        if self.chat:
            reply = await agent.chat(
                [{"role": "user", "content": text}],
                new_conversation=True,
                max_new_tokens=max_new,
                allowed=allowed,
            )
            said = reply.text
        else:
            said = (await agent.generate(text, max_new_tokens=max_new, allowed=allowed)).text
        return self.verdicts[self.verdict(said, episode=ctx.episode_id)]
