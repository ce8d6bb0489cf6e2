"""What turns a step's per-row advantages into the ones its loss is given, all before its first
update: GAE from a critic's values (`algorithm.critic`, trainers/critic.py) or the KL in the reward
(`klIn: reward`, step_inputs.kl_in_reward), each per token and normalised over every rank's trained
tokens, then a frozen teacher's per-token distillation signal (`algorithm.distillation`,
trainers/teacher.py). Collectives, in the same order on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl_runtime.algorithms.losses import LossConfig
from polyrl_runtime.experience.types import Sample
from polyrl_runtime.trainers.critic import Critic, Whitening
from polyrl_runtime.trainers.step_inputs import Scorer, ValueTargets, kl_in_reward, token_batch
from polyrl_runtime.trainers.teacher import Teacher


@dataclass(frozen=True)
class Shaped:
    """Each micro-batch's advantages ([rows] or [rows, R]) and reference logprobs, the critic's
    targets (with a critic) and the distillation's summed reverse KL and its tokens (with a teacher)."""

    advantages: list[torch.Tensor]
    refs: list[torch.Tensor | None]
    value_targets: ValueTargets | None = None
    distill_kl_sum: float = 0.0
    distill_tokens: int = 0


def shape(
    scorer: Scorer,
    samples: list[Sample],
    micro_rows: list[list[int]],
    *,
    advantages: list[torch.Tensor],
    prox: list[torch.Tensor | None],
    refs: list[torch.Tensor | None],
    signals: torch.Tensor,
    cfg: LossConfig,
    whitening: Whitening,
    policy: str,
    critic: Critic | None,
    teacher: Teacher | None,
) -> Shaped:
    targets = None
    if critic is not None:  # GAE from its values, klIn reward's KL in the token rewards
        advantages, refs, targets = critic.advantages(
            scorer, samples, micro_rows, prox=prox, refs=refs, signals=signals, cfg=cfg, whitening=whitening
        )
    elif cfg.kl_in == "reward":
        advantages, refs = kl_in_reward(
            scorer,
            samples,
            micro_rows,
            prox,
            signals,
            cfg=cfg,
            norm=whitening.norm,
            algorithm=whitening.algorithm,
            policy=policy,
            global_std=whitening.global_std,
            allreduce=whitening.allreduce,
            agent_stats=whitening.agent_stats,
        )
    if teacher is None:
        return Shaped(advantages, refs, targets)
    # The student's side of the reverse KL: the logprobs the step began with (proximal).
    student = [
        (p if p is not None else scorer.logprobs(token_batch(samples, rows)[0]))
        if rows
        else torch.zeros(0, 0)
        for rows, p in zip(micro_rows, prox, strict=True)
    ]
    distilled, kl, tokens = teacher.distil(samples, micro_rows, advantages, student, scorer.temperature)
    return Shaped(distilled, refs, targets, kl, tokens)
