"""How a policy learns (`spec.policies[].algorithm`): its advantage estimator and loss, their
hyper-parameters and options (DAPO's, a critic, distillation from a teacher, LoRA adapters)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from polyrl_operator.api.base import ApiModel, Rule
from polyrl_operator.api.common import DNS_LABEL_PATTERN
from polyrl_operator.api.model import Model


class Lora(ApiModel):
    """Low-rank adapters (peft's LoRA): only the adapters are trained and stored. The rollout engines
    serve the base weights with the adapters merged in, or, for policies whose rollouts share a pool
    and a base model (same model uri and dtype), one engine per pool pod holds the base once and each
    policy's adapter beside it."""

    rank: int = Field(16, ge=1, le=4096, description="Rank r of each adapter.")
    alpha: int = Field(
        32,
        ge=1,
        le=1_000_000,
        description="Scaling numerator: an adapter's update is (alpha / rank) * B @ A.",
    )
    dropout: float = Field(0.0, ge=0, lt=1.0, description="Dropout on the adapters' input while training.")
    target_modules: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=lambda: ["all-linear"],
        min_length=1,
        max_length=256,
        description="Names of the modules to adapt (e.g. q_proj, v_proj; a name matches a module whose "
        "path ends with it), or all-linear: every linear layer except the output head.",
    )


AlgorithmName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"]
"""The advantage estimators (the runtime's algorithms/estimators.py holds one entry for each)."""
GROUPED_ALGORITHMS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
"""Estimators whose baseline is the other episodes of the same task: they need groupSize >= 2."""
GROUPED_ALGORITHMS_CEL = "[" + ", ".join(f"'{n}'" for n in GROUPED_ALGORITHMS) + "]"
GROUPED_ALGORITHMS_TEXT = ", ".join(GROUPED_ALGORITHMS[:-1]) + " and " + GROUPED_ALGORITHMS[-1]
"""Their names in a message: "grpo, dr_grpo, ... and reinforce_pp_baseline"."""


class DynamicSampling(ApiModel):
    """DAPO's dynamic sampling: groups whose rewards are all equal carry no gradient and are dropped,
    so that every step trains on groups that do."""

    max_refills: int = Field(
        3,
        ge=0,
        le=1000,
        description="How many steps' worth of episodes (this many times training.episodesPerStep) a "
        "policy version may drop for equal rewards. Past it the version trains on such groups as "
        "they come (zero signal), so that a policy solving (or failing) every task still steps "
        "instead of sampling forever; a warning says so.",
    )


class Distillation(ApiModel):
    """On-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): a per-token signal from a
    frozen teacher's log-probabilities of the student's own samples."""

    teacher: str = Field(
        ...,
        pattern=DNS_LABEL_PATTERN,
        max_length=63,
        description="The frozen policy (frozen: true, in spec.policies) whose model scores the "
        "student's sampled tokens. Its tokenizer must be the student's: checked when the trainer starts.",
    )
    coef: float = Field(
        1.0,
        gt=0,
        le=100.0,
        description="Each trained token's advantage gets coef * (log pi_teacher - log pi_student) of that "
        "token added (the negative reverse KL, scored before the step's first update, without "
        "gradient), on top of the estimator's advantage from the episode's reward.",
    )


class OverlongPenalty(ApiModel):
    """DAPO's soft overlong punishment: a length penalty added to the reward of each response that
    comes near the most tokens a turn may have."""

    buffer_tokens: int = Field(
        ...,
        ge=1,
        le=1_048_576,
        description="The length of the penalty's ramp: a turn of L sampled tokens, at most maxLength, "
        "gets penaltyFactor * min(0, (maxLength - bufferTokens - L) / bufferTokens) added to its "
        "agent's return (0 down to -penaltyFactor at maxLength). Must be below maxLength.",
    )
    max_length: int | None = Field(
        None,
        ge=2,
        le=1_048_576,
        description="The length the ramp ends at; unset: the policy's rollout.sampling.maxNewTokens.",
    )
    penalty_factor: float = Field(
        1.0, gt=0, le=100.0, description="The penalty of a turn of maxLength sampled tokens or more."
    )


class Critic(ApiModel):
    """PPO's value model: advantages by generalised advantage estimation (GAE) from its per-token
    values instead of the batch mean. It is trained on the policy's trainer ranks, next to the
    policy, and checkpointed with it."""

    model: Model | None = Field(
        None,
        description="The value model's backbone, loaded as a copy of its own with a linear value head "
        "(initialised to zero) on its final hidden states. Unset: the policy's model. Not with lora.",
    )
    lr: float = Field(1.0e-5, gt=0, le=1.0, description="Learning rate of the value model (constant).")
    value_clip: float | None = Field(
        0.2,
        ge=0,
        le=1.0e6,
        description="PPO's value clipping: each value's loss is the larger of its squared error and "
        "that of the value the step began with moved by at most valueClip toward it. Unset or 0: "
        "unclipped.",
    )
    gamma: float = Field(
        1.0, ge=0, le=1.0, description="GAE's discount per trained token of a sequence (1: none)."
    )
    gae_lambda: float = Field(
        0.95,
        ge=0,
        le=1.0,
        description="GAE's lambda: 1 is the Monte Carlo return less the value (no bias, most "
        "variance), 0 the one-step temporal difference.",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        le=10_000_000,
        description="The first training steps in which only the value model trains (the policy's "
        "weights stay as they are), so that the policy's first updates use values that fit the "
        "returns (0: none).",
    )


class Algorithm(ApiModel):
    """The policy-gradient algorithm and its hyper-parameters."""

    __rules__ = (
        Rule(
            cel=f"!(self.name in {GROUPED_ALGORITHMS_CEL}) || self.groupSize >= 2",
            message=f"must be at least 2 for {GROUPED_ALGORITHMS_TEXT} (advantages are relative to the group)",
            check=lambda a: a.name not in GROUPED_ALGORITHMS or a.group_size >= 2,
            field=".groupSize",
        ),
        Rule(
            cel=f"!has(self.dynamicSampling) || self.name in {GROUPED_ALGORITHMS_CEL}",
            message=f"needs groups: equal rewards are found within a group of {GROUPED_ALGORITHMS_TEXT}",
            check=lambda a: a.dynamic_sampling is None or a.name in GROUPED_ALGORITHMS,
            field=".dynamicSampling",
        ),
        Rule(
            cel=f"!has(self.advantageNorm) || self.advantageNorm != 'per-group' || self.name in {GROUPED_ALGORITHMS_CEL}",
            message=f"per-group needs groups: it is for {GROUPED_ALGORITHMS_TEXT}",
            check=lambda a: a.advantage_norm != "per-group" or a.name in GROUPED_ALGORITHMS,
            field=".advantageNorm",
        ),
        Rule(
            cel="self.klIn != 'reward' || self.klCoef > 0.0",
            message="reward needs klCoef > 0 (the weight of the KL estimate it subtracts from the reward)",
            check=lambda a: a.kl_in != "reward" or a.kl_coef > 0,
            field=".klIn",
        ),
        Rule(
            cel=f"self.klIn != 'reward' || !(self.name in {GROUPED_ALGORITHMS_CEL})",
            message="reward is for reinforce_pp and ppo: a per-token KL shaping would corrupt the "
            f"group-centred signals of {GROUPED_ALGORITHMS_TEXT}",
            check=lambda a: a.kl_in != "reward" or a.name not in GROUPED_ALGORITHMS,
            field=".klIn",
        ),
        Rule(
            cel="!has(self.critic) || self.name == 'ppo'",
            message="is for ppo: the critic's values replace its batch-mean baseline",
            check=lambda a: a.critic is None or a.name == "ppo",
            field=".critic",
        ),
        Rule(
            cel="!has(self.critic) || !has(self.lora) || !has(self.critic.model)",
            message="model is not for a LoRA policy: its critic is a second adapter and a value head on "
            "the policy's own base; remove algorithm.critic.model",
            check=lambda a: a.critic is None or a.lora is None or a.critic.model is None,
            field=".critic.model",
        ),
    )

    name: AlgorithmName = Field(
        "grpo",
        description="The advantage estimator: grpo (reward minus the group's mean, scaled per policy), "
        "dr_grpo (Dr. GRPO: the same baseline, no division by a standard deviation), rloo (reward "
        "minus the mean of the group's other members), reinforce_pp (REINFORCE++: no groups, the "
        "reward normalised over the policy's batch), reinforce_pp_baseline (REINFORCE++-baseline: the "
        "reward minus its group's mean, then normalised over the policy's batch) or ppo (the raw reward minus the batch mean, or "
        "GAE on a value model's values with critic; by default one clipped optimizer step per "
        "micro-batch: see miniBatches).",
    )
    group_size: int = Field(
        8,
        ge=1,
        le=1024,
        description="Episodes of one task whose rewards are compared (grpo, dr_grpo, rloo, reinforce_pp_baseline). A group is as "
        "many episodes as the largest groupSize of the job's policies trained with those; a policy with "
        "a smaller one compares its rewards within consecutive sub-groups of its own size.",
    )
    advantage_norm: Literal["per-policy", "per-agent", "per-group", "global", "none"] | None = Field(
        None,
        description="Normalise advantages per policy (recommended for multi-agent training), per agent "
        "(each agent's samples with that agent's own statistics, for agents that share a policy through "
        "workflow.args.policies), per group (GRPO's original: each group-centred signal divided by "
        "the standard deviation of its group's rewards; the grouped estimators only), over all "
        "policies, or not at all. Unset: none for dr_grpo, else per-policy.",
    )
    lr: float = Field(1.0e-6, gt=0, le=1.0, description="Learning rate.")
    clip_eps: float = Field(
        0.2,
        gt=0,
        le=10.0,
        description="Clipping range of the probability ratio: [1 - clipEps, 1 + clipEpsHigh].",
    )
    clip_eps_high: float | None = Field(
        None,
        gt=0,
        le=10.0,
        description="Upper clipping range (DAPO's clip-higher: a larger one lets unlikely tokens rise "
        "further, against entropy collapse); unset: clipEps.",
    )
    dual_clip: float | None = Field(
        None,
        gt=1.0,
        le=100.0,
        description="Dual-clip PPO's bound c > 1: a token with a negative advantage loses at most c times "
        "its advantage, however large its ratio (unset: no bound).",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="Estimator of the KL penalty to the reference model (klCoef), from d = log ref - "
        "log pi of each sampled token: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 (unbiased, never "
        "negative).",
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="The probability ratio that is clipped: token (PPO: each token's pi / "
        "pi_proximal) or sequence (GSPO: each sequence's geometric mean of its tokens' ratios, the "
        "same for all its tokens; GSPO's paper clips it at clipEps 3e-4, clipEpsHigh 4e-4 and "
        "aggregates with seq-mean-token-mean).",
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = Field(
        "token-mean",
        description="How a step's per-token losses become one loss: token-mean (sum over the step's "
        "trained tokens / their count), seq-mean-token-sum (each sequence's token sum, averaged over "
        "the step's sequences) or seq-mean-token-mean (each sequence's token mean, averaged over "
        "the step's sequences). Counts are taken over every rank and micro-batch of the step, or of "
        "the mini-batch when a step takes several optimizer steps (miniBatches).",
    )
    mini_batches: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="Mini-batches a training step's batch is split into (each rank its share; each "
        "mini-batch one or more micro-batches, their gradients accumulated): one optimizer step per "
        "mini-batch per epoch, every one clipped around the proximal log-probabilities scored once "
        "before the step's first update (the decoupled objective: the importance weight pi_proximal "
        "/ pi_behaviour corrects the samples' staleness). Each step's loss is normalised over its "
        "own mini-batch (lossAggregation). Unset: the estimator's, 1 (one optimizer step per batch) "
        "for all but ppo, which takes one per micro-batch.",
    )
    epochs: int | None = Field(
        None,
        ge=1,
        le=100,
        description="Passes a training step makes over its mini-batches (epochs x miniBatches optimizer "
        "steps, all against the same proximal log-probabilities). Unset: 1.",
    )
    is_cap: float = Field(
        2.0,
        ge=1.0,
        le=100.0,
        description="Cap on the importance weight that corrects stale samples (the mask isCorrection modes keep weights within [1 / isCap, isCap]).",
    )
    is_correction: Literal["token-truncate", "sequence-truncate", "token-mask", "sequence-mask", "none"] = (
        Field(
            "token-truncate",
            description="The importance weight w of proximal vs behaviour (engine) log-probs: "
            "token-truncate: per token, min(pi_prox / mu, isCap); sequence-truncate: per sequence, "
            "min(prod over its trained tokens of pi_prox / mu, isCap) (in log space), on each of its "
            "tokens; token-mask: per token, pi_prox / mu where it lies within [1 / isCap, isCap], "
            "else 0 (the token is not trained on); sequence-mask: the same on the sequence's product "
            "(the whole sequence is rejected); none: w = 1.",
        )
    )
    kl_coef: float = Field(
        0.0, ge=0, le=100.0, description="Weight of a KL penalty to the initial policy (0: off)."
    )
    kl_in: Literal["loss", "reward"] = Field(
        "loss",
        description="Where the KL penalty to the reference model (klCoef, klEstimator) goes: loss (a "
        "per-token term of the loss, any estimator) or reward (REINFORCE++: each token's return is "
        "the reward minus klCoef times the sum of the KL estimates of that token and every later one "
        "of its sequence, taken without gradient against the proximal log-probabilities before the "
        "step's first update; the per-token advantages are then normalised over the batch's trained "
        "tokens as advantageNorm says, and the loss has no KL term). reward needs klCoef > 0 and "
        "reinforce_pp or ppo.",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        le=10.0,
        description="Weight of an entropy bonus that keeps the policy exploring (0: off).",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        le=10_000_000,
        description="Training steps over which the learning rate rises linearly from 0 to lr (0: none). "
        "The schedule counts training steps (policy versions), whatever the number of optimizer steps "
        "in each (epochs x miniBatches); a resumed job continues it from its step.",
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="Learning rate after warmup: constant, or cosine decay to minLrRatio * lr at "
        "training.totalSteps. Every optimizer step of a training step uses that step's rate.",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1.0, description="Final learning rate of the cosine schedule, as a fraction of lr."
    )
    max_grad_norm: float = Field(
        1.0, ge=0, le=1.0e6, description="Clip the global gradient norm to this value (0: no clipping)."
    )
    max_non_finite_steps: int = Field(
        3,
        ge=1,
        le=1000,
        description="An optimizer step whose gradient (or loss) is NaN or infinite is skipped: the "
        "weights and optimizer state stay as they were, and the training step's nonfinite_grad_steps "
        "metric counts it. After this many training steps in a row that skipped one, the policy's "
        "trainer fails (restarted from its latest checkpoint, frozen or failing the job, as "
        "failurePolicy says).",
    )
    dynamic_sampling: DynamicSampling | None = Field(
        None,
        description="Drop the groups whose rewards are all equal (DAPO's dynamic sampling; the "
        "grouped estimators): their samples are counted as dropped_zero_variance and more episodes "
        "are played in their place. Unset: such groups are trained on (they add no gradient but "
        "count toward the step).",
    )
    distillation: Distillation | None = Field(
        None,
        description="Learn from a frozen teacher policy's log-probabilities of the student's own "
        "samples (on-policy distillation); unset: none.",
    )
    overlong_filter: bool = Field(
        False,
        description="Do not train on turns cut at their maximum new tokens (DAPO's overlong "
        "filtering): their samples are counted as dropped_overlong. The episode's other turns "
        "are trained on, and the cut turn still counts in its group's rewards.",
    )
    overlong_penalty: OverlongPenalty | None = Field(
        None,
        description="Add DAPO's soft overlong penalty to the return of an agent for each of its "
        "turns that comes near the maximum length; unset: none.",
    )
    lora: Lora | None = Field(
        None,
        description="Train low-rank adapters instead of all weights (Hugging Face models only); unset "
        "trains every weight.",
    )
    critic: Critic | None = Field(
        None,
        description="A value model (ppo only): per-token advantages by GAE from its values, trained "
        "on the returns in the same step as the policy (with lora: a second adapter and a value head "
        "on the policy's own base). Unset: the batch mean is the baseline.",
    )
