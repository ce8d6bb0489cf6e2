"""The coordinator's ``GET /progress`` document: the one schema the runtime serves and the operator reads.

It lives in the operator's API package (pydantic only, no kopf, no Kubernetes client at import time)
because the runtime depends on polyrl-operator for the RLJob models already: both sides import this
module, so a field renamed on one side fails the other's type check and tests. The wire form is
camelCase JSON like the rest of the API. Unknown fields are ignored here (``extra="ignore"``) so a
newer runtime can add fields without breaking an older operator.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

PROGRESS_SCHEMA_VERSION = 1


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def to_wire(self) -> dict[str, object]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class Worker(_Wire):
    """One rollout engine or workflow worker as the coordinator sees it."""

    pod: str = Field(..., description="Pod name (POLYRL_POD_NAME of the worker).")
    utilisation: float = Field(0.0, ge=0.0, description="Busy fraction over the last interval (0..1).")
    in_flight: int = Field(0, ge=0, description="Requests or episodes running on it now.")
    draining: bool = Field(False, description="Seen the drain annotation; no new work is sent to it.")
    drained: bool = Field(False, description="Draining and nothing in flight: safe to delete.")
    version: int | None = Field(None, ge=0, description="Weight version loaded (engines only).")


class StalenessStats(_Wire):
    mean: float = Field(0.0, ge=0.0)
    max: int = Field(0, ge=0)


class EvalProgress(_Wire):
    """The latest evaluation pass of one policy on the job's eval rows (spec.evaluation)."""

    step: int = Field(..., ge=0, description="The policy's step (weight version) the pass ran at.")
    reward_mean: float | None = Field(None, description="Mean raw reward over the eval episodes.")
    pass_at_k: float | None = Field(
        None, ge=0, le=1, description="Fraction of eval rows solved by at least one of k episodes."
    )
    k: int = Field(1, ge=1, description="Episodes per eval row.")
    rows: int = Field(0, ge=0, description="Eval rows with a finished episode of the policy.")


class PolicyProgress(_Wire):
    """Progress of one policy."""

    name: str
    version: int = Field(0, ge=0, description="Latest weight version published by the trainer.")
    step: int = Field(0, ge=0, description="Optimizer steps done.")
    reward_mean: float | None = Field(None, description="Mean episode reward over the last step.")
    staleness: StalenessStats | None = None
    backlog: int = Field(0, ge=0, description="Generation requests waiting for one of its engines.")
    engines: list[Worker] = Field(default_factory=list, description="Its rollout engines.")
    last_checkpoint_step: int | None = Field(None, ge=0)
    evaluation: EvalProgress | None = Field(
        None, description="The latest evaluation pass, if the job evaluates."
    )
    restarts: int = Field(
        0, ge=0, description="Restarts of its trainer alone (failurePolicy), in this coordinator's run."
    )
    trainer_state: Literal["training", "restarting", "frozen", "done"] = Field(
        "training",
        description="restarting: its trainer failed and restarts from its latest checkpoint (its "
        "engines serve its last version meanwhile); frozen: it ran out of restarts under "
        "onPolicyFailure freeze and trains no more; done: it took its last step.",
    )
    rating: float | None = Field(
        None,
        description="A policy with a league: the rating of its newest version that played the "
        "league's snapshots (Bradley-Terry on the Elo scale, its version 0 at 1000). Unset before "
        "the first such game, and for a policy without a league.",
    )
    version_skew: dict[str, int] | None = Field(
        None,
        description="Per other policy met in its episodes: the largest number of versions they were "
        "apart among the episodes of its latest step that had any (each policy's version in an episode: "
        "the oldest of its sampled tokens). Unset before the first step or when it plays alone.",
    )


class WorkflowProgress(_Wire):
    backlog: int = Field(0, ge=0, description="Episodes waiting for a free workflow worker.")
    workers: list[Worker] = Field(default_factory=list)


class CheckpointProgress(_Wire):
    """State of the checkpoint the operator asked for (``POST /checkpoint``) and of the last one."""

    last_step: int | None = Field(None, ge=0, description="Step of the newest complete checkpoint.")
    last_request_id: str | None = Field(None, description="requestId of the last completed request.")
    in_progress: bool = False


class PoolProgress(_Wire):
    """One device pool whose devices take turns (a GPU pool hosting a trainer, spec.pools): what they
    did since the coordinator started. Other pools never switch and are not listed."""

    name: str = Field(..., description="Pool name (spec.pools[].name).")
    busy_fraction: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Fraction of the time a trainer's turn held the pool or its engines had episodes "
        "to generate.",
    )
    switches: int = Field(
        0, ge=0, description="Changes of holder: engines to a trainer, trainer to trainer, back."
    )
    switch_seconds: float = Field(
        0.0, ge=0.0, description="Seconds spent sleeping, waking, offloading and restoring roles."
    )
    resident_seconds: dict[str, float] = Field(
        default_factory=dict, description="Per policy: seconds its trainer held the pool."
    )
    turns: dict[str, int] = Field(
        default_factory=dict, description="Per policy: training turns its trainer took."
    )


class Progress(_Wire):
    """The whole ``GET /progress`` document."""

    schema_version: int = Field(PROGRESS_SCHEMA_VERSION, ge=1)
    state: Literal["starting", "running", "checkpointing", "done", "failed"] = "starting"
    message: str | None = Field(None, description="Why the job is done/failed, or what it is doing.")
    retryable: bool = Field(
        True, description="With state failed: False when restarting cannot help (bad workflow import)."
    )
    attempt: int | None = Field(
        None,
        ge=0,
        description=(
            "The restart attempt the coordinator belongs to (POLYRL_ATTEMPT); the operator ignores a "
            "document from another attempt. None outside a cluster (polyrl run)."
        ),
    )
    policies: list[PolicyProgress] = Field(default_factory=list)
    workflow: WorkflowProgress = Field(default_factory=WorkflowProgress)
    checkpoint: CheckpointProgress = Field(default_factory=CheckpointProgress)
    pools: list[PoolProgress] = Field(
        default_factory=list, description="The pools whose devices take turns (none without pools)."
    )

    def policy(self, name: str) -> PolicyProgress | None:
        return next((p for p in self.policies if p.name == name), None)

    def pool(self, name: str) -> PoolProgress | None:
        return next((q for q in self.pools if q.name == name), None)


class CheckpointRequest(_Wire):
    """Body of ``POST /checkpoint``: idempotent by requestId (a repeat of a known id is a no-op)."""

    request_id: str
    reason: Literal["suspend", "evicted"] = "suspend"
