"""The RLJob spec: what a user writes. Field names are the user-facing contract (DESIGN.md section 3)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from polyrl_operator.api.base import ApiModel, Rule, RuleViolation
from polyrl_operator.api.common import Replicas, RoleOverrides
from polyrl_operator.api.data import Data, Evaluation
from polyrl_operator.api.lora_serving import lora_serving_problems
from polyrl_operator.api.metrics import Metrics
from polyrl_operator.api.operation import FailurePolicy, Scheduling, Storage
from polyrl_operator.api.patterns import CHECKPOINT_URI_PATTERN, ENTRYPOINT_PATTERN
from polyrl_operator.api.policy import (
    DEFAULT_GPUS,
    GROUPED_ALGORITHMS,
    GROUPED_ALGORITHMS_CEL,
    Policy,
    Rollout,
    Trainer,
)
from polyrl_operator.api.pools import MAX_POOLS, Placement, Pool, SharedBase
from polyrl_operator.api.weight_sync import WeightSync

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
    episode_timeout_seconds: float = Field(
        300.0,
        gt=0,
        le=86_400.0,
        description="Seconds an episode may run: one still running then fails (reason timeout); "
        "its turns so far are trained on with failureReward, and its engine requests still in flight "
        "are aborted on their engines (their batch slots and KV cache freed).",
    )
    failure_reward: float | None = Field(
        None,
        ge=-1.0e6,
        le=1.0e6,
        description="The reward of each agent of an episode a policy made fail (a timeout, or the "
        "workflow raising PolicyFailure), whose turns are then trained on; unset: the agent's lowest "
        "reward among its group's finished episodes. Other failures are dropped and played again.",
    )
    replicas: Replicas = Field(
        default_factory=Replicas, description="Workflow worker pods that run episodes (elastic)."
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
            cel="!has(self.onVersionSkew) || has(self.maxVersionSkew)",
            message="needs maxVersionSkew: it says what happens to an episode over that bound",
            check=lambda s: s.on_version_skew is None or s.max_version_skew is not None,
            field=".onVersionSkew",
        ),
        Rule(
            cel="!has(self.maxVersionSkew) || self.maxVersionSkew >= 1 || "
            "(has(self.onVersionSkew) && self.onVersionSkew == 'drop')",
            message="must be >= 1 with onVersionSkew wait (the default): policies take their steps one "
            "at a time, so while one trains the policy that stepped last is a version ahead; 0 needs "
            "onVersionSkew drop",
            check=lambda s: (
                s.max_version_skew is None or s.max_version_skew >= 1 or s.on_version_skew == "drop"
            ),
            field=".maxVersionSkew",
        ),
        Rule(
            cel="size(self.policies) > 1 || ((!has(self.failurePolicy) || "
            "!has(self.failurePolicy.onPolicyFailure) || self.failurePolicy.onPolicyFailure != 'freeze') "
            "&& self.policies.all(p, !has(p.failurePolicy) || !has(p.failurePolicy.onPolicyFailure) || "
            "p.failurePolicy.onPolicyFailure != 'freeze'))",
            message="freeze needs two policies or more: a job whose only policy is frozen has nothing "
            "left to train (use failJob)",
            check=lambda s: (
                len(s.policies) > 1 or all(s.policy_failure(p.name)[1] != "freeze" for p in s.policies)
            ),
            field=".failurePolicy.onPolicyFailure",
        ),
        Rule(
            cel="self.policies.exists(p, !has(p.frozen) || !p.frozen)",
            message="at least one policy must be trained: every policy is frozen",
            check=lambda s: any(not p.frozen for p in s.policies),
            field=".policies",
        ),
        Rule(
            cel="!has(self.evaluation) || (has(self.data) && has(self.data.eval))",
            message="needs eval rows: set data.eval",
            check=lambda s: s.evaluation is None or (s.data is not None and s.data.eval is not None),
            field=".evaluation",
        ),
        Rule(
            cel=f"self.policies.all(p, (has(p.frozen) && p.frozen) || !(p.algorithm.name in {GROUPED_ALGORITHMS_CEL}) || "
            "self.training.episodesPerStep % p.algorithm.groupSize == 0)",
            message="must be a multiple of the groupSize of every policy trained with grpo, dr_grpo "
            "or rloo (episodes start, and steps train, in whole groups)",
            check=lambda s: all(
                p.frozen
                or p.algorithm.name not in GROUPED_ALGORITHMS
                or s.training.episodes_per_step % p.algorithm.group_size == 0
                for p in s.policies
            ),
            field=".training.episodesPerStep",
        ),
        Rule(
            # CEL lists hold one type: the rollout and the trainer are spelled out, not listed.
            cel="self.policies.all(p, "
            "(!has(p.rollout.pool) || (has(self.pools) && self.pools.exists(q, q.name == p.rollout.pool))) && "
            "(!has(p.trainer.pool) || (has(self.pools) && self.pools.exists(q, q.name == p.trainer.pool))))",
            message="a rollout or trainer names a pool that spec.pools does not define",
            check=lambda s: all(r.pool is None or r.pool in s.pool_names for r in s.policy_roles()),
            field=".policies",
        ),
        Rule(
            cel="!has(self.pools) || self.pools.all(q, self.policies.exists(p, "
            "(has(p.rollout.pool) && p.rollout.pool == q.name) || "
            "(has(p.trainer.pool) && p.trainer.pool == q.name)))",
            message="every pool must be named by a rollout or trainer (a pool no role uses would hold "
            "devices for nothing)",
            check=lambda s: all(q.name in {r.pool for r in s.policy_roles()} for q in s.pools or ()),
            field=".pools",
        ),
        Rule(
            cel="!has(self.pools) || self.policies.all(p, !has(p.rollout.pool) || "
            "p.rollout.engine != 'vllm' || self.pools.all(q, q.name != p.rollout.pool || q.gpus >= 1))",
            message="a pool that runs a vllm rollout (rollout.engine vllm, the default) must have gpus >= 1 "
            "(vLLM runs on GPUs only); on a CPU pool set the policy's rollout.engine: torch",
            check=lambda s: all(
                p.rollout.pool is None or p.rollout.engine != "vllm" or s.pool_gpus(p.rollout.pool) >= 1
                for p in s.policies
            ),
            field=".pools",
        ),
        Rule(
            cel="!has(self.pools) || self.policies.all(p, !has(p.trainer.pool) || "
            "!has(p.trainer.ranksPerPod) || self.pools.all(q, q.name != p.trainer.pool || q.gpus == 0 || "
            "q.gpus == p.trainer.ranksPerPod))",
            message="a trainer on a pool with GPUs runs one rank per GPU: its ranksPerPod must equal the "
            "pool's gpus",
            check=lambda s: all(
                p.frozen
                or p.trainer.pool is None
                or p.trainer.ranks_per_pod is None
                or s.pool_gpus(p.trainer.pool) in (0, p.trainer.ranks_per_pod)
                for p in s.policies
            ),
            field=".policies",
        ),
        Rule(
            cel="self.policies.all(p, !has(p.rollout.pool) || !has(p.trainer.pool) || "
            "p.rollout.pool == p.trainer.pool || "
            "!self.policies.exists(o, has(o.trainer.pool) && o.trainer.pool == p.rollout.pool))",
            message="a policy whose trainer is on one pool may run its rollout on another pool only if no "
            "trainer runs there: each pool's training turns would wait for the other's",
            check=lambda s: all(
                p.rollout.pool is None
                or p.trainer_pool in (None, p.rollout.pool)
                or all(o.trainer_pool != p.rollout.pool for o in s.policies)
                for p in s.policies
            ),
            field=".policies",
        ),
        Rule(
            cel="!has(self.weightSync) || !has(self.weightSync.deltas) || self.weightSync.deltas == 0 || "
            "(has(self.weightSync.transport) && self.weightSync.transport in ['objectstore', 'collective'])",
            message="deltas need transport objectstore or collective: objectstore keeps versions in a store an "
            "engine fetches from, collective sends each version to engines that hold the one before; shm "
            "and cudaipc hand each version over whole (storage writes deltas by fullEvery)",
            check=lambda s: (
                s.weight_sync.deltas == 0 or s.weight_sync.transport in ("objectstore", "collective")
            ),
            field=".weightSync.deltas",
        ),
        Rule(
            cel="!has(self.weightSync) || !has(self.weightSync.deltas) || self.weightSync.deltas == 0 || "
            "!has(self.weightSync.transport) || self.weightSync.transport != 'collective' || "
            "self.policies.all(p, has(p.rollout.engine) && p.rollout.engine == 'torch')",
            message="deltas over collective are read by torch engines: every policy needs rollout.engine "
            "torch (vLLM's worker receives whole versions)",
            check=lambda s: (
                s.weight_sync.deltas == 0
                or s.weight_sync.transport != "collective"
                or all(p.rollout.engine == "torch" for p in s.policies)
            ),
            field=".weightSync.deltas",
        ),
        Rule(
            cel="!has(self.weightSync) || self.weightSync.transport != 'cudaipc' || self.policies.all(p, "
            "(has(p.frozen) && p.frozen) || has(p.rollout.pool) && has(p.trainer.pool) && "
            "p.rollout.pool == p.trainer.pool && has(self.pools) && "
            "self.pools.exists(q, q.name == p.rollout.pool && q.replicas.max == 1))",
            message="cudaipc needs every trained policy's rollout and its trainer on one pool of one pod "
            "(replicas.max 1): engines copy the trainer's GPU memory, so they must share its host",
            check=lambda s: (
                s.weight_sync.transport != "cudaipc" or all(p.frozen or s.on_one_pod(p) for p in s.policies)
            ),
            field=".weightSync.transport",
        ),
        Rule(
            cel="!has(self.weightSync) || self.weightSync.transport != 'cudaipc' || !has(self.pools) || "
            "self.policies.all(p, !has(p.trainer.pool) || "
            "self.pools.all(q, q.name != p.trainer.pool || q.gpus >= 1))",
            message="cudaipc shares the trainer's CUDA memory: a pool that runs a trainer must have gpus >= 1",
            check=lambda s: (
                s.weight_sync.transport != "cudaipc"
                or all(
                    p.trainer_pool not in s.pool_names or s.pool_gpus(p.trainer_pool or "") >= 1
                    for p in s.policies
                )
            ),
            field=".weightSync.transport",
        ),
        Rule(
            cel="self.policies.all(p, !has(p.rollout.pool) || !has(p.algorithm) || !has(p.algorithm.lora) || "
            "self.policies.all(o, o.name == p.name || !(has(o.rollout.pool) && o.rollout.pool == p.rollout.pool && has(o.algorithm) && has(o.algorithm.lora) && o.model.uri == p.model.uri && (has(o.model.dtype) ? o.model.dtype : 'auto') == (has(p.model.dtype) ? p.model.dtype : 'auto')) || "
            "(has(o.rollout.engine) ? o.rollout.engine : 'vllm') == (has(p.rollout.engine) ? p.rollout.engine : 'vllm')))",
            message="policies that share a base model as LoRA adapters must agree on rollout.engine "
            "(one engine serves all of them)",
            check=lambda s: all(
                len({s.policy(n).rollout.engine for n in b.policies}) == 1 for b in s.shared_bases()
            ),
            field=".policies",
        ),
        Rule(
            cel="self.policies.all(p, !has(p.rollout.pool) || !has(p.algorithm) || !has(p.algorithm.lora) || "
            "self.policies.all(o, o.name == p.name || !(has(o.rollout.pool) && o.rollout.pool == p.rollout.pool && has(o.algorithm) && has(o.algorithm.lora) && o.model.uri == p.model.uri && (has(o.model.dtype) ? o.model.dtype : 'auto') == (has(p.model.dtype) ? p.model.dtype : 'auto')) || "
            "(has(o.model.trustRemoteCode) && o.model.trustRemoteCode) == "
            "(has(p.model.trustRemoteCode) && p.model.trustRemoteCode)))",
            message="policies that share a base model as LoRA adapters must agree on model.trustRemoteCode "
            "(one engine loads the base for all of them)",
            check=lambda s: all(
                len({s.policy(n).model.trust_remote_code for n in b.policies}) == 1 for b in s.shared_bases()
            ),
            field=".policies",
        ),
        Rule(
            cel="!has(self.weightSync) || !has(self.weightSync.transport) || "
            "!(self.weightSync.transport in ['collective', 'cudaipc', 'storage']) || "
            "self.policies.all(p, !has(p.rollout.pool) || !has(p.algorithm) || !has(p.algorithm.lora) || "
            "!self.policies.exists(o, o.name != p.name && has(o.rollout.pool) && o.rollout.pool == p.rollout.pool && has(o.algorithm) && has(o.algorithm.lora) && o.model.uri == p.model.uri && (has(o.model.dtype) ? o.model.dtype : 'auto') == (has(p.model.dtype) ? p.model.dtype : 'auto')))",
            message="policies that share a base model as LoRA adapters receive adapter versions through "
            "objectstore or shm (auto picks one): one engine serves them all, and collective, cudaipc and "
            "storage connect an engine to one policy's trainer",
            check=lambda s: (
                s.weight_sync.transport not in ("collective", "cudaipc", "storage") or not s.shared_bases()
            ),
            field=".weightSync.transport",
        ),
        Rule(
            cel="!has(self.weightSync) || !has(self.weightSync.transport) || "
            "self.weightSync.transport != 'storage' || "
            "self.policies.all(p, has(p.rollout.engine) && p.rollout.engine == 'torch')",
            message="transport storage is read by torch engines: every policy needs rollout.engine torch "
            "(vLLM engines receive through collective or cudaipc)",
            check=lambda s: (
                s.weight_sync.transport != "storage" or all(p.rollout.engine == "torch" for p in s.policies)
            ),
            field=".weightSync.transport",
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
    max_version_skew: int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="How many versions apart the policies of one episode may be (a policy's version in "
        "an episode: the oldest of its sampled tokens; policies that finished training do not count). "
        "What happens over the bound: onVersionSkew. Unset: no bound.",
    )
    on_version_skew: Literal["wait", "drop"] | None = Field(
        None,
        description="With maxVersionSkew: wait (the default) holds a policy back before a step that "
        "would take it more than maxVersionSkew versions ahead of the slowest policy still training, "
        "and keeps every episode (one may still span up to maxStaleness more, through its samples' "
        "staleness); drop trains every policy freely and drops, on arrival, an episode whose policies "
        "are further apart (counted as version_skew), failing the job if one policy can then no longer "
        "get a sample.",
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
    pools: list[Pool] | None = Field(
        None,
        max_length=MAX_POOLS,
        description="Device pools that rollouts and trainers share (their pool field); roles without a "
        "pool run on pods of their own.",
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

    @field_validator("pools")
    @classmethod
    def _unique_pool_names(cls, pools: list[Pool] | None) -> list[Pool] | None:
        names = [q.name for q in pools or ()]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"duplicate pool name {name!r}: pool names must be unique")
        return pools

    @model_validator(mode="after")
    def _adapters_fit_their_engine(self) -> RLJobSpec:
        # engineArgs is free-form (vLLM validates it), so the API server has no schema to check here.
        problems = lora_serving_problems(self.policies, self.shared_bases())
        if problems:
            field, message = problems[0]
            raise RuleViolation(f".{field}", message)
        return self

    @property
    def pool_names(self) -> frozenset[str]:
        return frozenset(q.name for q in self.pools or ())

    def policy_roles(self) -> list[Rollout | Trainer]:
        """Every policy's rollout and trainer (what the pool rules range over)."""
        return [r for p in self.policies for r in ((p.rollout,) if p.frozen else (p.rollout, p.trainer))]

    def policy(self, name: str) -> Policy:
        """The policy called `name` (KeyError when there is none)."""
        for p in self.policies:
            if p.name == name:
                return p
        raise KeyError(f"no policy {name!r} in spec.policies")

    def pool(self, name: str) -> Pool:
        """The pool called `name` (KeyError when spec.pools has none: validation rules that out)."""
        for q in self.pools or ():
            if q.name == name:
                return q
        raise KeyError(f"no pool {name!r} in spec.pools")

    def pool_gpus(self, name: str) -> int:
        """GPUs per pod of the pool `name`; 0 when it is not defined (another rule reports that)."""
        return next((q.gpus for q in self.pools or () if q.name == name), 0)

    def rollout_placement(self, policy: Policy) -> Placement:
        """The policy's rollout engines' pods: its own (replicas, gpus) or one per pod of its pool."""
        r = policy.rollout
        if r.pool is not None:
            q = self.pool(r.pool)
            return Placement(q.name, q.gpus, q.gpu_type, q.replicas.min, q.replicas.max)
        replicas = r.replicas or Replicas()
        gpus = DEFAULT_GPUS if r.gpus is None else r.gpus
        return Placement(None, gpus, r.gpu_type, replicas.min, replicas.max)

    def on_one_pod(self, policy: Policy) -> bool:
        """Whether the policy's engines and trainer ranks all run in one pod: both on one pool
        that has a single pod (they share its host memory, so weights need no network)."""
        r, t = policy.rollout, policy.trainer_pool
        return r.pool is not None and r.pool == t and self.pool(r.pool).replicas.max == 1

    def shared_bases(self) -> list[SharedBase]:
        """Policies that share one base model as LoRA adapters: those whose rollouts run on the same
        pool with the same `model.uri` and `model.dtype` and that set `algorithm.lora`; a group of two
        or more, in the order of `policies` (one engine per pool pod serves every policy of a group)."""
        groups: dict[tuple[str, str, str], list[str]] = {}
        for p in self.policies:
            if p.rollout.pool is not None and p.algorithm.lora is not None:
                groups.setdefault((p.rollout.pool, p.model.uri, p.model.dtype), []).append(p.name)
        return [
            SharedBase(pool, uri, dtype, tuple(names))
            for (pool, uri, dtype), names in groups.items()
            if len(names) > 1
        ]

    def shared_base(self, policy: str) -> SharedBase | None:
        """The group whose base `policy` shares, if any."""
        return next((b for b in self.shared_bases() if policy in b.policies), None)

    def trainer_placement(self, policy: Policy) -> Placement:
        """The policy's trainer ranks' pods: `replicas` of its own, or its pool's first
        `replicas.min` pods; one rank per GPU (or ranksPerPod, 1 by default, on CPU). A frozen
        policy's: no pods, no ranks."""
        t = policy.trainer
        if policy.frozen:
            return Placement(None, 0, None, 0, 0, 0)
        if t.pool is not None:
            q = self.pool(t.pool)
            pods, gpus, gpu_type = q.replicas.min, q.gpus, q.gpu_type
        else:
            pods, gpus, gpu_type = t.replicas or 1, DEFAULT_GPUS if t.gpus is None else t.gpus, t.gpu_type
        return Placement(t.pool, gpus, gpu_type, pods, pods, t.ranks_per_pod or max(gpus, 1))

    def policy_failure(self, name: str) -> tuple[int, Literal["failJob", "freeze"]]:
        """(maxRestarts, onPolicyFailure) for policy `name`'s trainer: its own failurePolicy's
        fields where set, else the job's."""
        own, job = self.policy(name).failure_policy, self.failure_policy
        limit = own.max_restarts if own is not None and own.max_restarts is not None else job.max_restarts
        action = own.on_policy_failure if own is not None and own.on_policy_failure else job.on_policy_failure
        return limit, action

    @property
    def version_skew_action(self) -> Literal["wait", "drop"] | None:
        """What bounds the policies' version skew: None when maxVersionSkew is unset, else
        onVersionSkew (default wait)."""
        if self.max_version_skew is None:
            return None
        return self.on_version_skew or "wait"

    @property
    def effective_max_staleness(self) -> int:
        """Versions a sample may lag: 0 in sync mode, the spec value (default 2) in async mode."""
        if self.mode == "sync":
            return 0
        return 2 if self.max_staleness is None else self.max_staleness
