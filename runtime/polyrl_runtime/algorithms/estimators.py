"""The advantage estimators, one table keyed by the API's `algorithm.name` values: what the workflow
worker turns a group's rewards into (each sample's learning signal), how the trainer scales those
signals into advantages, and how many optimizer steps a training step takes when the policy leaves
`algorithm.miniBatches` and `algorithm.epochs` unset. Code outside this module asks the table, never
the name.

| name | signal (worker) | advantage (trainer, `advantageNorm`) | optimizer steps (unset) |
|---|---|---|---|
| grpo | r - mean of the group | scaled by the RMS of the non-zero signals (default per-policy) | one per batch |
| dr_grpo | r - mean of the group | not scaled (default `none`: Dr. GRPO has no std) | one per batch |
| rloo | r - mean of the group's other members | as grpo | one per batch |
| reinforce_pp | r | centred and scaled by the batch's mean and std (REINFORCE++) | one per batch |
| reinforce_pp_baseline | r - mean of the group | as reinforce_pp (REINFORCE++-baseline) | one per batch |
| ppo | r | as reinforce_pp | one per micro-batch |

A training step makes `epochs` passes over `miniBatches` mini-batches of the batch (each rank its
share; trainers/batching.py), one optimizer step per mini-batch per pass, every one of them against
the proximal log-probabilities scored once before the first (AReaL's decoupled objective: the ratio
is clipped around pi_prox, and the importance weight pi_prox / mu corrects the behaviour policy's
staleness). One optimizer step (miniBatches 1, epochs 1: grpo's default) has pi_prox = pi, ratio 1;
ppo's default is one mini-batch per micro-batch, epochs 1.

Dr. GRPO (Liu et al., 2025) also drops GRPO's per-sequence length normalisation; the loss here is
already a mean over all tokens of the step, so no sequence's tokens weigh more for it being short.
RLOO's leave-one-out baseline is n/(n-1) times GRPO's group-centred signal: unbiased, where the
group mean includes the sample itself. REINFORCE++ normalises over the batch rather than the group;
REINFORCE++-baseline (Hu et al., 2025) is its variant for group sampling: the group mean is
subtracted first, so each question's difficulty leaves the signal, and the batch's mean and std over
every sample (a tied group's zeros included, as published) then scale it. REINFORCE++'s
KL-in-the-reward is `algorithm.klIn: reward` (algorithms/kl_reward.py: per-token returns, the
reward less the KL to go, normalised over the batch's trained tokens), for the estimators whose
signal is the raw reward (reinforce_pp, ppo); by default (`klIn: loss`) the KL penalty, `klCoef`, is
a term of the loss, for every estimator.

ppo with `algorithm.critic` replaces the batch-mean baseline with a value model's: per-token
advantages by GAE (algorithms/gae.py) on its values, with the reward (and, under klIn reward, the
per-token KL) as token rewards, normalised over the batch's trained tokens as advantageNorm says; the
value model trains on the GAE returns in the same step, on the policy's trainer ranks
(trainers/critic.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from polyrl_operator.api.algorithm import AlgorithmName

Baseline = Literal["group_mean", "leave_one_out", "none"]
Norm = Literal["per-policy", "per-agent", "per-group", "global", "none"]


@dataclass(frozen=True)
class Estimator:
    name: str
    baseline: Baseline  # what the worker subtracts from each reward within a group
    default_norm: Norm  # the advantageNorm when the policy leaves it unset
    # Mini-batches of a step when algorithm.miniBatches is unset (None: one per micro-batch).
    default_mini_batches: int | None
    default_epochs: int = 1  # passes over them when algorithm.epochs is unset
    # The trainer centres and scales the signals by the batch's mean and std over every sample, even
    # where the worker centred them within their group (REINFORCE++-baseline).
    batch_normalised: bool = False

    @property
    def grouped(self) -> bool:
        """Its baseline is the other episodes of the same task: episodes run in groups of groupSize."""
        return self.baseline != "none"

    @property
    def centred(self) -> bool:
        """The trainer takes its signals as centred by the worker (it does not subtract a mean, and
        scales by the spread of the signals that carry a gradient)."""
        return self.grouped and not self.batch_normalised


ESTIMATORS: Mapping[str, Estimator] = {
    e.name: e
    for e in (
        Estimator("grpo", "group_mean", "per-policy", default_mini_batches=1),
        Estimator("dr_grpo", "group_mean", "none", default_mini_batches=1),
        Estimator("rloo", "leave_one_out", "per-policy", default_mini_batches=1),
        Estimator("reinforce_pp", "none", "per-policy", default_mini_batches=1),
        Estimator(
            "reinforce_pp_baseline", "group_mean", "per-policy", default_mini_batches=1, batch_normalised=True
        ),
        Estimator("ppo", "none", "per-policy", default_mini_batches=None),
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


def update_schedule(name: str, mini_batches: int | None, epochs: int | None) -> tuple[int | None, int]:
    """A policy's mini-batches per step (None: one per micro-batch) and passes over them: its
    `algorithm.miniBatches` and `algorithm.epochs`, else its estimator's."""
    e = estimator(name)
    return (e.default_mini_batches if mini_batches is None else mini_batches), (
        e.default_epochs if epochs is None else epochs
    )
