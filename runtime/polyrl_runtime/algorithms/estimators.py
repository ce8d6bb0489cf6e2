"""The advantage estimators, one table keyed by the API's `algorithm.name` values: what the workflow
worker turns a group's rewards into (each sample's learning signal), how the trainer scales those
signals into advantages, and whether the trainer takes one optimizer step per micro-batch against
proximal log-probabilities. Code outside this module asks the table, never the name.

| name | signal (worker) | advantage (trainer, `advantageNorm`) | optimizer steps |
|---|---|---|---|
| grpo | r - mean of the group | scaled by the RMS of the non-zero signals (default per-policy) | one per batch |
| dr_grpo | r - mean of the group | not scaled (default `none`: Dr. GRPO has no std) | one per batch |
| rloo | r - mean of the group's other members | as grpo | one per batch |
| reinforce_pp | r | centred and scaled by the batch's mean and std (REINFORCE++) | one per batch |
| ppo | r | as reinforce_pp | one per micro-batch (clipped, proximal) |

Dr. GRPO (Liu et al., 2025) also drops GRPO's per-sequence length normalisation; the loss here is
already a mean over all tokens of the step, so no sequence's tokens weigh more for it being short.
RLOO's leave-one-out baseline is n/(n-1) times GRPO's group-centred signal: unbiased, where the
group mean includes the sample itself. REINFORCE++ normalises over the batch rather than the group;
its KL-in-the-reward is `algorithm.klIn: reward` (algorithms/kl_reward.py: per-token returns, the
reward less the KL to go, normalised over the batch's trained tokens), for the estimators whose
signal is the raw reward (reinforce_pp, ppo); by default (`klIn: loss`) the KL penalty, `klCoef`, is
a term of the loss, for every estimator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from polyrl_operator.api.policy import AlgorithmName

Baseline = Literal["group_mean", "leave_one_out", "none"]
Norm = Literal["per-policy", "per-agent", "per-group", "global", "none"]


@dataclass(frozen=True)
class Estimator:
    name: str
    baseline: Baseline  # what the worker subtracts from each reward within a group
    default_norm: Norm  # the advantageNorm when the policy leaves it unset
    proximal_steps: bool  # one clipped optimizer step per micro-batch against proximal logprobs

    @property
    def grouped(self) -> bool:
        """Its baseline is the other episodes of the same task: episodes run in groups of groupSize."""
        return self.baseline != "none"

    @property
    def centred(self) -> bool:
        """Its signals are centred by the worker already (the trainer does not subtract a mean, and
        scales by the spread of the signals that carry a gradient)."""
        return self.grouped


ESTIMATORS: Mapping[str, Estimator] = {
    e.name: e
    for e in (
        Estimator("grpo", "group_mean", "per-policy", proximal_steps=False),
        Estimator("dr_grpo", "group_mean", "none", proximal_steps=False),
        Estimator("rloo", "leave_one_out", "per-policy", proximal_steps=False),
        Estimator("reinforce_pp", "none", "per-policy", proximal_steps=False),
        Estimator("ppo", "none", "per-policy", proximal_steps=True),
    )
}
assert set(ESTIMATORS) == set(get_args(AlgorithmName)), "one estimator per API name"


def estimator(name: str) -> Estimator:
    """The estimator `algorithm.name` names; a ValueError listing the known ones otherwise."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r} (known: {', '.join(ESTIMATORS)})") from None


def normalisation(name: str, advantage_norm: str | None) -> str:
    """The advantage normalisation a policy trains with: its `advantageNorm`, else its estimator's."""
    return advantage_norm if advantage_norm is not None else estimator(name).default_norm
