"""The RLJob spec: what a user writes. Field names are the user-facing contract (DESIGN.md section 3)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from polyrl_operator.api.base import ApiModel, Rule
from polyrl_operator.api.common import DNS_LABEL_PATTERN, Replicas, RoleOverrides
from polyrl_operator.api.data import Data, Evaluation
from polyrl_operator.api.metrics import Metrics
from polyrl_operator.api.patterns import (
    CHECKPOINT_URI_PATTERN,
    ENTRYPOINT_PATTERN,
    GPU_TYPE_PATTERN,
    MODEL_URI_PATTERN,
    SECRET_NAME_PATTERN,
)

MAX_POLICIES = 16


class Training(ApiModel):
    """How long to train and how much experience each optimizer step consumes."""

    total_steps: int = Field(
        ..., ge=1, le=10_000_000, description="Optimizer steps per policy before the job succeeds."
    )
    episodes_per_step: int = Field(
        64,
        ge=1,
        le=1_000_000,
        description="Episodes whose samples make up one optimizer step of each policy.",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for sampling, shuffling and initialisation.")


class Workflow(RoleOverrides):
    """The multi-agent episode program: a class, given as an import path, whose async ``run_episode``
    calls the agents by policy name and returns per-agent turns and rewards."""

    entrypoint: str = Field(
        ...,
        max_length=256,
        pattern=ENTRYPOINT_PATTERN,
        description="Import path 'package.module:ClassName'. Checked for form only; the runtime imports it.",
    )
    args: dict[str, Any] | None = Field(
        None, description="Keyword arguments for the workflow class (free-form)."
    )
    replicas: Replicas = Field(
        default_factory=Replicas, description="Workflow worker pods that run episodes (elastic)."
    )


class Model(ApiModel):
    """Where the policy's initial weights come from."""

    uri: str = Field(
        ...,
        max_length=1024,
        pattern=MODEL_URI_PATTERN,
        description="A Hugging Face model directory (pvc://CLAIM/PATH, file:///PATH or s3://BUCKET/PREFIX; "
        "s3:// is downloaded once per node, credentials from spec.storage.credentialsSecret) or "
        "builtin://NAME: builtin://tiny-qwen2 is a tiny Qwen2 built in code "
        "(a real Hugging Face model for CPU examples and tests), builtin://tiny a plain-torch toy.",
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
    """Low-rank adapters (peft's LoRA): only the adapters are trained and stored; the rollout engines
    serve the base weights with the adapters merged in."""

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


class Algorithm(ApiModel):
    """The policy-gradient algorithm and its hyper-parameters."""

    __rules__ = (
        Rule(
            cel="self.name != 'grpo' || self.groupSize >= 2",
            message="must be at least 2 for grpo (advantages are relative to the group)",
            check=lambda a: a.name != "grpo" or a.group_size >= 2,
            field=".groupSize",
        ),
    )

    name: Literal["grpo", "ppo"] = Field(
        "grpo", description="grpo (group-relative advantages) or ppo (clipped)."
    )
    group_size: int = Field(
        8, ge=1, le=1024, description="Episodes sharing a prompt whose rewards are compared (grpo)."
    )
    advantage_norm: Literal["per-policy", "per-agent", "global", "none"] = Field(
        "per-policy",
        description="Normalise advantages per policy (recommended for multi-agent training), per agent "
        "(each agent's samples with that agent's own statistics, for agents that share a policy through "
        "workflow.args.policies), over all policies, or not at all.",
    )
    lr: float = Field(1.0e-6, gt=0, le=1.0, description="Learning rate.")
    clip_eps: float = Field(0.2, gt=0, le=10.0, description="PPO clipping range.")
    is_cap: float = Field(
        2.0, ge=1.0, le=100.0, description="Cap on the importance weight that corrects stale samples."
    )
    kl_coef: float = Field(
        0.0, ge=0, le=100.0, description="Weight of a KL penalty to the initial policy (0: off)."
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
    lora: Lora | None = Field(
        None,
        description="Train low-rank adapters instead of all weights (Hugging Face models only); unset "
        "trains every weight.",
    )


# vLLM engine arguments the runtime derives from the spec or needs for correctness (the logprob
# convention, per-version prefix-cache reset, the weight-update worker extension, GPUs = TP size).
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
)


class Sampling(ApiModel):
    """Sampling parameters of the rollout engine."""

    temperature: float = Field(1.0, ge=0, le=10.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1.0, description="Nucleus sampling threshold.")
    max_new_tokens: int = Field(256, ge=1, le=1_048_576, description="Most tokens generated per agent turn.")


EngineName = Literal["vllm", "torch"]
"""The rollout engines (the runtime's engine registry holds one class for each)."""


class Rollout(RoleOverrides):
    """The inference fleet that generates this policy's actions."""

    __rules__ = (
        Rule(
            cel="self.engine != 'vllm' || self.gpus >= 1",
            message="must be at least 1 for engine vllm (vLLM runs on GPUs only)",
            check=lambda r: r.engine != "vllm" or r.gpus >= 1,
            field=".gpus",
        ),
    )

    engine: EngineName = Field("vllm", description="vllm (GPU) or torch (the small built-in CPU engine).")
    replicas: Replicas = Field(default_factory=Replicas, description="Rollout engine pods (elastic).")
    gpus: int = Field(1, ge=0, le=64, description="GPUs per rollout pod (nvidia.com/gpu).")
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
            cel="!has(self.ranksPerPod) || self.gpus == 0 || self.ranksPerPod == self.gpus",
            message="must equal gpus when gpus > 0 (one rank per GPU)",
            check=lambda t: t.ranks_per_pod is None or t.gpus in (0, t.ranks_per_pod),
            field=".ranksPerPod",
        ),
    )

    backend: Literal["deepspeed"] = Field("deepspeed", description="Training backend.")
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage (0-3).")
    replicas: int = Field(1, ge=1, le=1000, description="Data-parallel trainer pods.")
    gpus: int = Field(1, ge=0, le=64, description="GPUs per trainer pod (nvidia.com/gpu); 0 trains on CPU.")
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

    @property
    def ranks(self) -> int:
        """Ranks per pod: ranksPerPod, else one per GPU, else 1."""
        return self.ranks_per_pod or max(self.gpus, 1)


class Policy(ApiModel):
    """One independently weighted agent policy with its own model, rollout fleet and trainer."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=40,
        pattern=DNS_LABEL_PATTERN,
        description="Policy name, used in pod names and by the workflow to call the agent (a DNS label).",
    )
    model: Model = Field(..., description="Initial weights.")
    algorithm: Algorithm = Field(default_factory=Algorithm, description="RL algorithm.")
    rollout: Rollout = Field(default_factory=Rollout, description="Inference fleet.")
    trainer: Trainer = Field(default_factory=Trainer, description="Training fleet.")


# `auto` and the transports the runtime registers (polyrl_runtime/weights/registry.py takes its list
# from here).
TransportName = Literal["auto", "objectstore", "shm", "collective"]


class WeightSync(ApiModel):
    """How each trainer ships new weights to its policy's rollout engines."""

    transport: TransportName = Field(
        "auto",
        description="auto picks the best available; objectstore (Ray, works everywhere), shm (same host), "
        "collective (gloo on CPU, NCCL on GPU).",
    )
    bucket_mb: int = Field(256, ge=1, le=16384, alias="bucketMB", description="Flattened bucket size in MiB.")
    inflight: Literal["keep", "wait", "abort"] = Field(
        "keep",
        description="What a weight update does to generations in progress (engine vllm): keep pauses "
        "them between two decoding steps and continues them on the new weights (partial rollouts; each "
        "token records the version that sampled it), wait lets them finish on the old weights first, "
        "abort stops them and issues them again on the new weights.",
    )


class Checkpoint(ApiModel):
    """Periodic checkpoints of weights, optimizer state, experience buffers and counters."""

    uri: str | None = Field(
        None,
        max_length=1024,
        pattern=CHECKPOINT_URI_PATTERN,
        description="Where to write checkpoints (pvc://CLAIM/PATH, file:///PATH or s3://BUCKET/PREFIX; "
        "s3:// credentials from spec.storage.credentialsSecret); unset keeps them in the "
        "coordinator's local storage only.",
    )
    every_steps: int = Field(50, ge=1, le=10_000_000, description="Checkpoint every N optimizer steps.")
    keep: int = Field(3, ge=1, le=1000, description="How many recent checkpoints to keep.")
    export_every: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Also export each policy as a Hugging Face model directory (merged weights, config, "
        "tokenizer) under <checkpoint uri>/export/step-NNNNNN/<policy> every N optimizer steps; "
        "unset exports only at the end of training.",
    )


class Storage(ApiModel):
    """Access to object storage (s3:// URIs of models and checkpoints)."""

    credentials_secret: str | None = Field(
        None,
        max_length=253,
        pattern=SECRET_NAME_PATTERN,
        description="A Secret in the job's namespace whose keys every pod of the job gets as environment "
        "variables (envFrom): AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, optionally AWS_SESSION_TOKEN, "
        "AWS_REGION and AWS_ENDPOINT_URL (an S3-compatible server such as MinIO or SeaweedFS). Unset: "
        "the pods' own environment (e.g. the node's or service account's IAM role). Never logged.",
    )


class FailurePolicy(ApiModel):
    """What to do when pods fail."""

    max_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="Restarts of the training roles (from the last checkpoint) before Failed.",
    )


class Scheduling(ApiModel):
    """Admission and priority."""

    queue_name: str | None = Field(
        None,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="Kueue LocalQueue that admits the job as one unit. Unset: the job's "
        "kueue.x-k8s.io/queue-name label, as Kueue reads it on its own jobs; when both are set, this "
        "field wins.",
    )
    priority_class_name: str | None = Field(
        None,
        max_length=253,
        description=(
            "The job's priority. With a queue it is resolved as Kueue does: a Kueue "
            "WorkloadPriorityClass of this name first (it orders admission and preemption; pods get "
            "no priorityClassName), else a scheduling.k8s.io PriorityClass (the Workload and every "
            "pod use it). Without a queue: the PriorityClass of every pod."
        ),
    )


class Coordinator(RoleOverrides):
    """The coordinator pod (Ray head and driver)."""

    dashboard: bool = Field(
        False,
        description="Serve the Ray dashboard from the head on port 8265 of the coordinator pod and "
        "Service (kubectl port-forward svc/<job>-coordinator 8265). Off by default: the dashboard's "
        "processes cost the head memory and CPU, and without it neither the pod nor the Service "
        "exposes the port.",
    )


class RLJobSpec(ApiModel):
    """Desired state of a multi-policy reinforcement-learning job."""

    __rules__ = (
        Rule(
            cel="self.mode == 'async' || !has(self.maxStaleness) || self.maxStaleness == 0",
            message="must be 0 or unset in sync mode (sync training is strictly on-policy)",
            check=lambda s: s.mode == "async" or not s.max_staleness,
            field=".maxStaleness",
        ),
        Rule(
            cel="!has(self.evaluation) || (has(self.data) && has(self.data.eval))",
            message="needs eval rows: set data.eval",
            check=lambda s: s.evaluation is None or (s.data is not None and s.data.eval is not None),
            field=".evaluation",
        ),
        Rule(
            cel="self.policies.all(p, p.algorithm.name != 'grpo' || "
            "self.training.episodesPerStep % p.algorithm.groupSize == 0)",
            message="must be a multiple of every grpo policy's groupSize (episodes start, and steps "
            "train, in whole groups)",
            check=lambda s: all(
                p.algorithm.name != "grpo" or s.training.episodes_per_step % p.algorithm.group_size == 0
                for p in s.policies
            ),
            field=".training.episodesPerStep",
        ),
    )

    image: str | None = Field(
        None,
        max_length=512,
        description="Default container image for every role (operator setting if unset).",
    )
    suspend: bool = Field(
        False, description="Suspend: checkpoint, delete the pods, keep status; false resumes."
    )
    mode: Literal["sync", "async"] = Field(
        "async",
        description="sync: generate, train, sync strictly on-policy; async: overlap with bounded staleness.",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        le=64,
        description="async only: how many versions a sample may lag its policy (default 2).",
    )
    training: Training = Field(..., description="Length of training and experience per step.")
    workflow: Workflow = Field(..., description="The multi-agent episode program.")
    policies: list[Policy] = Field(
        ...,
        min_length=1,
        max_length=MAX_POLICIES,
        description="The policies (agents) trained together; names must be unique.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    data: Data | None = Field(None, description="Prompt data rows played by the workflow (ctx.sample).")
    evaluation: Evaluation | None = Field(None, description="Periodic evaluation on data.eval (unset: none).")
    weight_sync: WeightSync = Field(default_factory=WeightSync, description="Weight transport settings.")
    checkpoint: Checkpoint = Field(default_factory=Checkpoint, description="Checkpoint settings.")
    storage: Storage = Field(default_factory=Storage, description="Object storage credentials.")
    metrics: Metrics = Field(
        default_factory=Metrics, description="Per-step metrics: the JSONL series and optional sinks."
    )
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy, description="Restart budget.")
    scheduling: Scheduling | None = Field(None, description="Kueue queue and priority class.")
    coordinator: Coordinator = Field(default_factory=Coordinator, description="Coordinator pod overrides.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the job this long after it Succeeded or Failed (unset: keep)."
    )
    active_deadline_seconds: int | None = Field(
        None,
        ge=1,
        description="Fail the job (reason DeadlineExceeded) once it has run this long, counted from "
        "status.startTime over the whole job (restarts and suspensions included); the coordinator is "
        "asked to checkpoint first, waiting at most the operator's checkpoint timeout. Unset: no limit.",
    )

    @field_validator("policies")
    @classmethod
    def _unique_policy_names(cls, policies: list[Policy]) -> list[Policy]:
        # The API server enforces this through x-kubernetes-list-type=map keyed by name.
        seen: set[str] = set()
        for p in policies:
            if p.name in seen:
                raise ValueError(f"duplicate policy name {p.name!r}: policy names must be unique")
            seen.add(p.name)
        return policies

    @property
    def effective_max_staleness(self) -> int:
        """Versions a sample may lag: 0 in sync mode, the spec value (default 2) in async mode."""
        if self.mode == "sync":
            return 0
        return 2 if self.max_staleness is None else self.max_staleness
