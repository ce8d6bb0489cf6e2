"""What a training step trains on, all of it fixed before the step's first update: each row's model
inputs and behaviour logprobs, the batch's advantages, the proximal and reference logprobs (scored
without gradient at the weights the step began with) and, under klIn reward, the shaped per-token
advantages. The trainer's loop (trainers/deepspeed_trainer.py) only runs forwards and backwards over
them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from polyrl_runtime.algorithms.advantages import AdvantageStats, advantages
from polyrl_runtime.algorithms.kl_reward import AgentStats, shaped_returns, token_advantages, token_kl
from polyrl_runtime.algorithms.losses import LossConfig, LossStats, TokenBatch, sequence_logprobs
from polyrl_runtime.algorithms.step_metrics import TOKEN_WEIGHTED
from polyrl_runtime.experience.batches import SampleBatch
from polyrl_runtime.experience.types import Sample
from polyrl_runtime.trainers.batching import StepLayout
from polyrl_runtime.trainers.lora import reference_model

# One token of prompt and one of response: the input of an empty micro-batch's zero-weighted step.
PAD_ROW = TokenBatch.build([np.zeros(1, np.int32)], [np.zeros(1, np.int32)], [np.zeros(0, np.int32)])

Allreduce = Callable[[list[float]], list[float]]  # sums over the policy's ranks


@dataclass(frozen=True)
class ValueTargets:
    """What a critic (trainers/critic.py) trains on, per micro-batch ([rows, R] on the CPU; None for
    an empty one): its values before the step's first update and the GAE returns."""

    old_values: list[torch.Tensor | None]
    returns: list[torch.Tensor | None]


@dataclass(frozen=True)
class StepInputs:
    """A rank's step, fixed before its first update. Per micro-batch (`layout.micro_rows`): its
    advantages ([rows] or, klIn reward or a critic, [rows, R]), proximal logprobs (None: the weights
    now, for a step of one optimizer step) and reference logprobs (None: scored in its forward). Per
    mini-batch (`minis`, each its micro-batch indices): the all-reduced loss denominator, and whether
    any rank has a row of it. `value_targets`: the critic's, with `algorithm.critic`."""

    samples: list[Sample]
    signals: torch.Tensor
    layout: StepLayout
    minis: list[list[int]]
    denominators: list[float]
    trains: list[bool]
    advantages: list[torch.Tensor]
    prox: list[torch.Tensor | None]
    refs: list[torch.Tensor | None]
    value_targets: ValueTargets | None = None
    # algorithm.distillation: the rank's summed reverse KL to the teacher and its trained tokens.
    distill: tuple[float, int] = (0.0, 0)


@dataclass
class LossTotals:
    """What a step's passes add up for its report: the sum of its optimizer steps' losses (their
    numerators over their denominators) and the token-weighted loss statistics of every pass."""

    loss: float = 0.0
    tokens: int = 0
    weighted: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TOKEN_WEIGHTED, 0.0))

    def add(self, stats: LossStats) -> None:
        for key in TOKEN_WEIGHTED:
            self.weighted[key] += getattr(stats, key) * stats.tokens
        self.tokens += stats.tokens

    def per_token(self) -> dict[str, Any]:
        """The token-weighted loss metrics, as `StepResult` keyword arguments."""
        return {key: total / max(self.tokens, 1) for key, total in self.weighted.items()}


def token_batch(samples: list[Sample], rows: list[int]) -> tuple[TokenBatch, torch.Tensor]:
    """The rows' model inputs and [rows, R] behaviour logprobs. Each row carries the temperature
    its tokens were sampled at: the policy's, or the call's own (`Turn.temperature`). The
    trainer's, proximal and reference logprobs of the row are all taken at it, so that they and
    the behaviour logprobs are of one distribution (the rank's own temperature only scores
    `PAD_ROW`)."""
    tb = TokenBatch.build(
        [samples[i].prompt_ids for i in rows],
        [samples[i].response_ids for i in rows],
        [samples[i].allowed_ids for i in rows],
        [samples[i].loss_mask for i in rows],
        [samples[i].temperature for i in rows],
    )
    width = tb.targets.shape[1]
    behav = torch.zeros(len(rows), width)
    for j, i in enumerate(rows):
        lp = samples[i].logprobs
        behav[j, : len(lp)] = torch.from_numpy(lp.astype(np.float32))
    return tb, behav


def signals_of(batch: SampleBatch | None) -> torch.Tensor:
    """[rows] the learning signals the workflow worker computed (the samples' rewards)."""
    return torch.from_numpy(batch.rewards.astype(np.float32)) if batch is not None else torch.zeros(0)


def batch_advantages(
    signals: torch.Tensor,
    stats: AdvantageStats,
    agents: tuple[str, ...],
    *,
    norm: str,
    algorithm: str,
    global_std: float | None,
    agent_stats: AgentStats,
) -> torch.Tensor:
    """[rows] the rank's advantages: its signals scaled with the all-reduced `stats` (per agent, with
    every rank's statistics of each agent, under per-agent normalisation: a collective)."""
    return advantages(
        signals,
        norm,
        stats,
        algorithm=algorithm,
        global_std=global_std,
        agents=agents,
        by_agent=agent_stats(signals, agents) if norm == "per-agent" else None,
    )


def mini_batch_counts(
    samples: list[Sample], micro_rows: list[list[int]], minis: list[list[int]]
) -> list[float]:
    """Per mini-batch (`minis`: its micro-batches' indices), the rank's trained tokens and sequences,
    interleaved [tokens_0, sequences_0, tokens_1, ...]: what each optimizer step's loss is divided
    by once all-reduced (`losses.aggregation_denominator`)."""
    counts: list[float] = []
    for mini in minis:
        rows = [i for k in mini for i in micro_rows[k]]
        counts += [float(sum(int(np.count_nonzero(samples[i].loss_mask)) for i in rows)), float(len(rows))]
    return counts


@dataclass(frozen=True)
class Scorer:
    """The rank's models as a step scores them without gradient. `engine`: the trained one (DeepSpeed's
    engine or one with its forward); `ref`: a separate reference model, or None; `lora_reference`:
    the reference is the engine's module with its adapters switched off (LoRA with klCoef > 0)."""

    engine: Any
    ref: Any
    temperature: float
    lora_reference: bool

    @classmethod
    def of(cls, engine: Any, ref: Any, temperature: float, cfg: LossConfig, lora: bool) -> Scorer:
        return cls(engine, ref, temperature, lora_reference=ref is None and cfg.kl_coef > 0 and lora)

    def logprobs(self, tb: TokenBatch) -> torch.Tensor:
        """[B, R] the rows' logprobs under the weights now."""
        with torch.no_grad():
            return sequence_logprobs(self.engine, tb, self.temperature)

    def reference(self, tb: TokenBatch) -> torch.Tensor | None:
        """[B, R] the reference policy's logprobs of the rows; None without one (klCoef 0)."""
        with torch.no_grad():
            if self.ref is not None:
                return sequence_logprobs(self.ref, tb, self.temperature)
            if self.lora_reference:
                # LoRA: the initial policy is the trained model with its adapters switched off.
                with reference_model(self.engine.module):
                    return sequence_logprobs(self.engine, tb, self.temperature)
        return None


def score_before_update(
    scorer: Scorer, samples: list[Sample], micro_rows: list[list[int]], *, proximal: bool, reference: bool
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Each micro-batch's proximal logprobs (when `proximal`) and reference logprobs (when
    `reference`), scored once at the weights the step began with; None for an empty micro-batch or
    what is not asked for."""
    prox: list[torch.Tensor | None] = [None] * len(micro_rows)
    refs: list[torch.Tensor | None] = [None] * len(micro_rows)
    for k, rows in enumerate(micro_rows):
        if rows and (proximal or reference):
            tb = token_batch(samples, rows)[0]
            prox[k] = scorer.logprobs(tb) if proximal else None
            refs[k] = scorer.reference(tb) if reference else None
    return prox, refs


def kl_in_reward(
    scorer: Scorer,
    samples: list[Sample],
    micro_rows: list[list[int]],
    prox: list[torch.Tensor | None],
    rewards: torch.Tensor,
    *,
    cfg: LossConfig,
    norm: str,
    algorithm: str,
    policy: str,
    global_std: float | None,
    allreduce: Allreduce,
    agent_stats: AgentStats,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """klIn reward (algorithms/kl_reward.py): each micro-batch's [rows, R] advantages and its
    reference logprobs. The KL is taken against the proximal logprobs: those scored before the first
    update, else (a step of one optimizer step) the weights now, at which every micro-batch of the
    step is scored. A collective (the normalisation all-reduces): every rank calls it."""
    refs: list[torch.Tensor | None] = []
    returns: list[torch.Tensor] = []  # an empty micro-batch's: [0, 0], as its mask; no agents
    masks: list[torch.Tensor] = []
    agents: list[list[str]] = []
    with torch.no_grad():
        for k, rows in enumerate(micro_rows):
            if not rows:
                refs.append(None)
                returns.append(torch.zeros(0, 0))
                masks.append(torch.zeros(0, 0))
                agents.append([])
                continue
            tb = token_batch(samples, rows)[0]
            ref = scorer.reference(tb)
            if ref is None:  # the API refuses klIn reward without klCoef > 0, which builds one
                raise ValueError(f"policy {policy}: algorithm.klIn reward needs klCoef > 0")
            refs.append(ref)
            old = prox[k]
            old = scorer.logprobs(tb) if old is None else old
            mask = tb.response_mask.to(old.device)
            kl = token_kl(ref, old, cfg.kl_estimator)
            returns.append(shaped_returns(rewards[rows].to(old.device), kl, mask, cfg.kl_coef))
            masks.append(mask)
            agents.append([samples[i].agent for i in rows])
    shaped = token_advantages(
        returns,
        masks,
        agents,
        norm,
        algorithm=algorithm,
        allreduce=allreduce,
        agent_stats=agent_stats,
        global_std=global_std,
    )
    return shaped, refs
