"""DAPO's handling of responses that reach their length limit (Yu et al. 2025), from an episode's
generation calls (`EpisodeContext.calls`): overlong filtering (turns with a call cut at its maximum
new tokens are not trained on: `algorithm.overlongFilter`) and the soft overlong punishment (a
length penalty on the agent's return: `algorithm.overlongPenalty`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from polyrl_operator.api.policy import Policy
from polyrl_runtime.workflows.api import CallRecord


@dataclass(frozen=True)
class Ramp:
    """The soft overlong penalty of one policy: 0 up to `max_length - buffer` sampled tokens, then
    falling linearly to `-factor` at `max_length`, and `-factor` beyond."""

    buffer: int
    max_length: int
    factor: float

    @classmethod
    def of(cls, policy: Policy) -> Ramp | None:
        p = policy.algorithm.overlong_penalty
        return None if p is None else cls(p.buffer_tokens, policy.overlong_max_length, p.penalty_factor)

    def penalty(self, tokens: int) -> float:
        start = self.max_length - self.buffer
        if tokens <= start:
            return 0.0
        if tokens <= self.max_length:
            return self.factor * (start - tokens) / self.buffer
        return -self.factor


def overlong_penalties(calls: Sequence[CallRecord], ramps: Mapping[str, Ramp]) -> dict[str, float]:
    """Per agent of a policy with a ramp: the sum of its calls' penalties (each call's sampled
    tokens against its policy's ramp), to add to its return."""
    out: dict[str, float] = {}
    for c in calls:
        ramp = ramps.get(c.policy)
        if ramp is not None:
            out[c.agent] = out.get(c.agent, 0.0) + ramp.penalty(c.tokens)
    return out


def overlong_turns(calls: Sequence[CallRecord], filtered: frozenset[str]) -> list[int]:
    """The indices of the turns (of policies in `filtered`) that a call was cut at its maximum new
    tokens in, ascending."""
    return sorted({c.turn_index for c in calls if c.truncated and c.policy in filtered})
