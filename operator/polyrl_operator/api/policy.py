"""One policy's part of the spec: its model, algorithm, rollout fleet and trainer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from polyrl_operator.api.algorithm import Algorithm
from polyrl_operator.api.base import ApiModel, Rule, RuleViolation
from polyrl_operator.api.common import DNS_LABEL_PATTERN, Replicas, RoleOverrides
from polyrl_operator.api.league import League
from polyrl_operator.api.model import Model
from polyrl_operator.api.patterns import GPU_TYPE_PATTERN

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
            cel="!has(self.frozen) || !self.frozen || !has(self.algorithm.distillation)",
            message="a frozen policy is not trained: it has nothing to distil into (remove "
            "algorithm.distillation; a frozen policy can be the teacher)",
            check=lambda p: not p.frozen or p.algorithm.distillation is None,
            field=".algorithm.distillation",
        ),
        Rule(
            cel="!has(self.algorithm) || !has(self.algorithm.distillation) || "
            "self.algorithm.distillation.teacher != self.name",
            message="must name another policy: a policy cannot be its own teacher",
            check=lambda p: p.algorithm.distillation is None or p.algorithm.distillation.teacher != p.name,
            field=".algorithm.distillation.teacher",
        ),
        Rule(
            cel="!has(self.frozen) || !self.frozen || !has(self.failurePolicy)",
            message="a frozen policy has no trainer to restart (remove failurePolicy)",
            check=lambda p: not p.frozen or p.failure_policy is None,
            field=".failurePolicy",
        ),
        Rule(
            cel="!has(self.frozen) || !self.frozen || !has(self.algorithm.critic)",
            message="a frozen policy is never trained: it has no value model to train (remove "
            "algorithm.critic)",
            check=lambda p: not p.frozen or p.algorithm.critic is None,
            field=".algorithm.critic",
        ),
        Rule(
            cel="!has(self.algorithm) || !has(self.algorithm.critic) || !has(self.algorithm.lora) || "
            "!has(self.trainer) || !has(self.trainer.zeroStage) || self.trainer.zeroStage != 3",
            message="a LoRA policy's critic is an adapter on the policy's base, which ZeRO-3 "
            "partitions: use zeroStage 0-2 (only the adapters train, and they are small enough to "
            "replicate)",
            check=lambda p: (
                p.algorithm.critic is None or p.algorithm.lora is None or p.trainer.zero_stage != 3
            ),
            field=".trainer.zeroStage",
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
            cel="!has(self.league) || !has(self.league.residentSnapshots) || !has(self.algorithm) || "
            "!has(self.algorithm.lora)",
            message="is for a policy without LoRA: a LoRA policy's snapshots are adapters on its base, "
            "all of them resident (remove residentSnapshots)",
            check=lambda p: (
                p.league is None or p.league.resident_snapshots is None or p.algorithm.lora is None
            ),
            field=".league.residentSnapshots",
        ),
        Rule(
            cel="!has(self.league) || !has(self.league.residentSnapshots) || "
            "self.league.residentSnapshots <= (has(self.league.keep) ? self.league.keep : 4)",
            message="must be at most league.keep: a serving copy beyond the snapshots held would stay empty",
            check=lambda p: p.league is None or (p.league.resident_snapshots or 1) <= p.league.keep,
            field=".league.residentSnapshots",
        ),
        Rule(
            cel="!has(self.league) || !(has(self.frozen) && self.frozen)",
            message="a frozen policy has one version: it has no past versions to play (remove league)",
            check=lambda p: p.league is None or not p.frozen,
            field=".league",
        ),
        Rule(
            cel="!has(self.league) || (has(self.rollout) && has(self.rollout.engine) && "
            "self.rollout.engine == 'torch')",
            message="needs rollout.engine torch: the torch engine holds snapshots of past adapter "
            "versions, vLLM engines hold none",
            check=lambda p: p.league is None or p.rollout.engine == "torch",
            field=".league",
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
    league: League | None = Field(
        None,
        description="Keep snapshots of this policy's past versions and play them as opponents "
        "(ctx.opponent in the workflow): an opponent's turns at a snapshot are never trained on. "
        "Needs algorithm.lora and rollout.engine torch.",
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
