"""A generic single-turn workflow for data-driven jobs: no workflow code needed.

Each group plays one row of `spec.data.train`: the agent answers the row's `prompt` (plain text) or
`messages` (a chat, rendered with the policy's chat template) and is rewarded by a reward function
(a built-in name or `module:attr`, rewards/) that compares the completion with the row's `answer`.

    workflow:
      entrypoint: polyrl_runtime.workflows.prompts:PromptCompletion
      args: {reward: math, agent: solver}

Arguments beside `reward` and `agent`:
- `chat` (default false): a `prompt` row is sent as one user message through the chat template (an
  instruct model's form) rather than as plain text;
- `instruction`: text appended to a `prompt` on a line of its own (say, how to write the answer);
- `extract` (default `reply`): what of the reply the reward scores: `reply` (all of it, stripped),
  `answer_tag` (the text inside the last `<answer>...</answer>`; nothing when there is none), or
  `last_line` (the last line that is not blank), or `last_number` (the last number written, as
  digits: `12`, `-3`, `2.5`; nothing when there is none), how small models answer arithmetic;
- `max_new_tokens`: the reply's length cap;
- `judge` (instead of `reward`): the reply is scored by asking a judge policy (workflows/judge.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from polyrl_runtime.rewards.builtins import last_number
from polyrl_runtime.rewards.load import load_reward
from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow
from polyrl_runtime.workflows.judge import Judge

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _answer_tag(reply: str) -> str:
    found = _ANSWER_TAG.findall(reply)
    return str(found[-1]).strip() if found else ""


def _last_line(reply: str) -> str:
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _last_number(reply: str) -> str:
    found = last_number(reply)
    if found is None:
        return ""
    return str(int(found)) if found.is_integer() else repr(found)


EXTRACTORS: dict[str, Callable[[str], str]] = {
    "reply": str.strip,
    "answer_tag": _answer_tag,
    "last_line": _last_line,
    "last_number": _last_number,
}


class PromptCompletion(Workflow):
    def __init__(
        self,
        reward: str | None = None,
        agent: str = "agent",
        max_new_tokens: int | None = None,
        *,
        chat: bool = False,
        instruction: str | None = None,
        extract: str = "reply",
        judge: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if reward is not None and judge is not None:
            raise ValueError(
                "workflow.args: set reward or judge, not both (the judge's verdict is the reward)"
            )
        self.judge = Judge.parse(judge) if judge is not None else None
        if self.judge is not None and self.judge.agent == agent:
            raise ValueError(f"workflow.args.judge.agent must differ from the agent it judges ({agent!r})")
        reward = reward or "exact_match"
        load_reward(reward)  # a bad name fails the job at start, not every episode
        if extract not in EXTRACTORS:
            raise ValueError(f"workflow.args.extract {extract!r}: expected one of {', '.join(EXTRACTORS)}")
        self.reward, self.agent, self.max_new_tokens = reward, agent, max_new_tokens
        self.chat, self.instruction, self.extract = chat, instruction, EXTRACTORS[extract]

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        row = ctx.sample
        if row is None:
            raise ValueError("PromptCompletion plays rows of spec.data.train, and the job has no spec.data")
        agent = ctx.agent(self.agent)
        # A row with neither field: the KeyError names the file, the row index and the row's fields.
        prompt: Any
        if "messages" in row:
            prompt = agent.chat_prompt(row["messages"])
        else:
            text = str(row["prompt"]) + (f"\n{self.instruction}" if self.instruction else "")
            prompt = agent.chat_prompt([{"role": "user", "content": text}]) if self.chat else text
        reply = await agent.generate(prompt, max_new_tokens=self.max_new_tokens)
        answer = self.extract(reply.text)
        if self.judge is None:
            r = ctx.reward(self.reward, answer)
            return Outcome({self.agent: r}, {"success": r})
        question = str(row["prompt"]) if "prompt" in row else str(row["messages"][-1]["content"])
        reference = str(row["answer"]) if "answer" in row else None
        r = await self.judge.score(ctx, question=question, answer=answer, reference=reference)
        return Outcome({self.agent: r, self.judge.agent: 0.0}, {"success": r})
