"""The RLJob status: written by the operator only (git owns spec, the operator owns status)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from polyrl_operator.api.base import ApiModel

Phase = Literal["Pending", "Admitted", "Running", "Suspended", "Succeeded", "Failed"]
PHASES: tuple[Phase, ...] = get_args(Phase)
ConditionType = Literal[
    "Admitted", "Ready", "Progressing", "Suspended", "Succeeded", "Failed", "QuotaExceeded", "PolicyFrozen"
]


class Condition(ApiModel):
    """A metav1.Condition: usable with ``kubectl wait --for=condition=TYPE``."""

    type: str = Field(..., max_length=316, description="Condition type, e.g. Ready or Succeeded.")
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation this was computed from."
    )
    last_transition_time: str = Field(
        ..., json_schema_extra={"format": "date-time"}, description="When status last changed (RFC 3339)."
    )
    reason: str = Field(
        ...,
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="CamelCase machine-readable reason.",
    )
    message: str = Field("", max_length=32768, description="Human-readable details.")


class RoleCounts(ApiModel):
    """Desired and ready pod counts of one role."""

    desired: int = Field(0, ge=0, description="Pods the operator wants (the autoscaler's decision).")
    ready: int = Field(0, ge=0, description="Pods that are running and ready.")
    pool: str | None = Field(
        None,
        description="Set when the role runs on this device pool: the counts are then the pool's pods "
        "it runs on (a rollout: every pod of the pool; a trainer: the first replicas.min).",
    )


class Staleness(ApiModel):
    """How many versions trained samples lagged the policy."""

    mean: float = Field(0.0, ge=0, description="Mean lag over recent samples.")
    max: int = Field(0, ge=0, description="Largest lag over recent samples.")


class EvalStatus(ApiModel):
    """The latest evaluation pass of a policy on the job's eval rows (spec.evaluation)."""

    step: int = Field(..., ge=0, description="The policy's step when the pass ran.")
    reward_mean: float | None = Field(None, description="Mean raw reward over the eval episodes.")
    pass_at_k: float | None = Field(
        None, ge=0, le=1, description="Fraction of eval rows solved by at least one of k episodes."
    )
    k: int = Field(1, ge=1, description="Episodes per eval row.")


class PolicyStatus(ApiModel):
    """Progress of one policy."""

    name: str = Field(..., description="Policy name.")
    version: int = Field(0, ge=0, description="Latest weight version published by the trainer.")
    step: int = Field(0, ge=0, description="Optimizer steps done.")
    reward_mean: float | None = Field(None, description="Mean episode reward over the last step.")
    staleness: Staleness | None = Field(None, description="Sample staleness over the last step.")
    rollout: RoleCounts = Field(default_factory=RoleCounts, description="Rollout pods.")
    trainer: RoleCounts = Field(default_factory=RoleCounts, description="Trainer pods.")
    last_checkpoint_step: int | None = Field(None, ge=0, description="Step of the newest checkpoint.")
    evaluation: EvalStatus | None = Field(None, description="The latest evaluation pass (spec.evaluation).")
    rating: float | None = Field(
        None,
        description="A policy with a league: its newest rated version's rating (Bradley-Terry, Elo "
        "scale, version 0 at 1000). Unset before its first game against a snapshot.",
    )
    restarts: int = Field(
        0,
        ge=0,
        description="Restarts of this policy's trainer alone (failurePolicy.maxRestarts), counted "
        "since the coordinator last started.",
    )
    trainer_state: Literal["training", "restarting", "frozen", "done"] | None = Field(
        None,
        description="training, restarting (from its latest checkpoint, the others training on), "
        "frozen (out of restarts under onPolicyFailure freeze: serving its last version untrained) "
        "or done. Unset before the coordinator reports.",
    )


class SharedBaseStatus(ApiModel):
    """Policies whose rollouts share one engine per pod of a pool: one resident base model, each
    trained policy's LoRA adapter on it, the frozen ones served the base alone."""

    model: str = Field(..., description="The base model (model.uri).")
    dtype: str = Field(..., description="Its dtype (model.dtype).")
    policies: list[str] = Field(
        ...,
        description="The policies it serves: the trained ones as LoRA adapters, the frozen ones the base.",
    )
    frozen: list[str] | None = Field(
        None, description="The frozen policies among them, served the base model alone; unset when none."
    )


class PoolStatus(ApiModel):
    """One device pool: its pods, the roles placed on it and how its devices were shared."""

    name: str = Field(..., description="Pool name (spec.pools[].name).")
    desired: int = Field(0, ge=0, description="Pool pods the operator wants (the autoscaler's decision).")
    ready: int = Field(0, ge=0, description="Pool pods that are running and ready.")
    roles: list[str] = Field(
        default_factory=list,
        description="The roles placed on the pool, as policy/role (e.g. solver/rollout).",
    )
    busy_fraction: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Fraction of the time a trainer's turn held the pool or its engines had episodes "
        "to generate, since the coordinator started; unset on a pool that takes no turns (no trainer, "
        "or no GPUs).",
    )
    switches: int | None = Field(
        None,
        ge=0,
        description="Changes of the pool's holder (engines to a trainer, trainer to trainer, back) "
        "since the coordinator started; unset on a pool that takes no turns (no trainer, or no GPUs).",
    )
    shared_bases: list[SharedBaseStatus] | None = Field(
        None,
        description="Policies served on one base model by the pool's engines (rollouts on the pool with "
        "the same model, with algorithm.lora or frozen, one LoRA policy at least); unset when none share.",
    )


class RLJobStatus(ApiModel):
    """Observed state of an RLJob."""

    phase: Phase = Field("Pending", description="Pending, Admitted, Running, Suspended, Succeeded or Failed.")
    observed_generation: int | None = Field(None, ge=0, description="metadata.generation last acted upon.")
    conditions: list[Condition] | None = Field(
        None,
        description="Admitted, Ready, Progressing, Suspended, Succeeded, Failed, QuotaExceeded, "
        "PolicyFrozen (True while a policy is frozen: out of restarts under onPolicyFailure freeze).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    policies: list[PolicyStatus] | None = Field(
        None,
        description="Per-policy progress and pod counts.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    policy_summary: str | None = Field(
        None,
        max_length=4096,
        description="Compact per-policy progress for `kubectl get`: name:vVERSION per policy, "
        "space-separated, e.g. `speaker:v41 listener:v40` (printer columns can show only one "
        "element of a list).",
    )
    rating_summary: str | None = Field(
        None,
        max_length=4096,
        description="Compact ratings for `kubectl get`: name:RATING per policy with a league that has "
        "one, space-separated, e.g. `player:1147`; unset when none has.",
    )
    workflow: RoleCounts | None = Field(None, description="Workflow pods.")
    pools: list[PoolStatus] | None = Field(
        None,
        description="Per-pool pod counts and the roles placed on each (spec.pools).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    pool_summary: str | None = Field(
        None,
        max_length=4096,
        description="Compact per-pool pods for `kubectl get -o wide`: name:READY/DESIRED per pool, "
        "space-separated, e.g. `shared:2/3`; unset without pools.",
    )
    step: int | None = Field(
        None,
        ge=0,
        description="Job progress: the smallest step over all policies while it runs; the "
        "final step (the largest) once it Succeeded.",
    )
    restarts: int = Field(
        0,
        ge=0,
        description="Restarts of the job's training roles from the latest complete checkpoint so far "
        "(the coordinator failed, or a pool pod hosting a trainer did). A policy's trainer restarting "
        "alone counts in policies[].restarts instead.",
    )
    start_time: str | None = Field(
        None,
        json_schema_extra={"format": "date-time"},
        description="When its pods were first created; activeDeadlineSeconds counts from here.",
    )
    completion_time: str | None = Field(
        None, json_schema_extra={"format": "date-time"}, description="When it Succeeded or Failed."
    )
    message: str | None = Field(None, max_length=32768, description="Why the job is in its phase.")
