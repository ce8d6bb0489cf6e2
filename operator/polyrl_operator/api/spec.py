"""The RLJob spec: what a user writes. Field names are the user-facing contract (DESIGN.md section 3)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from polyrl_operator.api.base import ApiModel, RuleViolation
from polyrl_operator.api.common import Replicas, RoleOverrides
from polyrl_operator.api.data import Data, Evaluation
from polyrl_operator.api.lora_serving import lora_serving_problems
from polyrl_operator.api.metrics import Metrics
from polyrl_operator.api.operation import FailurePolicy, Scheduling, Storage
from polyrl_operator.api.patterns import CHECKPOINT_URI_PATTERN, ENTRYPOINT_PATTERN
from polyrl_operator.api.policy import DEFAULT_GPUS, Policy, Rollout, Trainer
from polyrl_operator.api.pools import MAX_POOLS, Placement, Pool, SharedBase
from polyrl_operator.api.spec_rules import SPEC_RULES
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

    __rules__ = SPEC_RULES

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

    def shares_gpus_across_pods(self, policy: Policy) -> bool:
        """Whether the policy's engines and trainer ranks share the GPUs of a pool of several pods
        (rank 0 and the engine of pod 0 on one GPU, other engines on other hosts): NCCL refuses two
        ranks on one GPU, and device-to-device copies reach one host only, so its weights go through
        host memory (objectstore)."""
        r, t = policy.rollout, policy.trainer_pool
        return (
            not policy.frozen
            and r.pool is not None
            and r.pool == t
            and self.pool_gpus(r.pool) >= 1
            and self.pool(r.pool).replicas.max > 1
        )

    def shared_bases(self) -> list[SharedBase]:
        """Policies that share one base model: those whose rollouts run on the same pool with the
        same `model.uri` and `model.dtype` and that set `algorithm.lora` (served as adapters) or are
        frozen (served the base alone); a group of two or more with one LoRA policy at least, in the
        order of `policies` (one engine per pool pod serves every policy of a group)."""
        groups: dict[tuple[str, str, str], list[Policy]] = {}
        for p in self.policies:
            if p.rollout.pool is not None and (p.algorithm.lora is not None or p.frozen):
                groups.setdefault((p.rollout.pool, p.model.uri, p.model.dtype), []).append(p)
        return [
            SharedBase(
                pool,
                uri,
                dtype,
                tuple(p.name for p in members),
                frozen=tuple(p.name for p in members if p.frozen),
            )
            for (pool, uri, dtype), members in groups.items()
            if len(members) > 1 and any(not p.frozen for p in members)
        ]

    def shared_base(self, policy: str) -> SharedBase | None:
        """The group whose base `policy` shares, if any."""
        return next((b for b in self.shared_bases() if policy in b.policies), None)

    def served_as_adapter(self, policy: str) -> bool:
        """Whether `policy`'s engines hold its LoRA adapter beside the base rather than the merged
        weights: it shares a base, or it is a LoRA policy with a league (its snapshots are copies of
        the adapter). Its trainer then publishes the adapter alone."""
        p = self.policy(policy)
        return self.shared_base(policy) is not None or (p.league is not None and p.algorithm.lora is not None)

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
