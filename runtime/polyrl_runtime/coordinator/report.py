"""What the driver reports: the `/progress` document the operator polls and the summary of a run.

Both are built from a `JobSnapshot`, a typed copy of the job's state the driver takes when asked
(`Driver.snapshot`), never from the driver's internals."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from polyrl_operator.api import RLJobSpec
from polyrl_operator.api.progress import (
    CheckpointProgress,
    EvalProgress,
    PolicyProgress,
    PoolProgress,
    Progress,
    StalenessStats,
    Worker,
    WorkflowProgress,
)
from polyrl_runtime.actors import Actor
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.metrics.records import SeriesEnds, StepRecord
from polyrl_runtime.coordinator.pool_scheduler import PoolUsage
from polyrl_runtime.coordinator.slots import Slot
from polyrl_runtime.experience.client import BufferClient

if TYPE_CHECKING:  # the driver's modules import torch; `polyrl run` loads them while Ray starts
    from polyrl_runtime.coordinator.job_state import PolicyRun, State, TrainerState

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class PolicySnapshot:
    name: str
    step: int
    last_reward: float | None
    staleness: tuple[float, int]
    last_ckpt_step: int | None
    engines: list[Worker]  # the live engines
    backlog: int  # requests queued on the live engines
    evaluation: EvalProgress | None = None
    version_skew: dict[str, int] = field(default_factory=dict)
    version: int | None = None  # None: the step (a trainer that never restarted alone)
    restarts: int = 0
    trainer_state: TrainerState = "training"
    # Its live engines' aborted requests and the tokens those did not generate (an engine of a
    # shared base counts every policy's).
    aborted_requests: int = 0
    freed_tokens: int = 0
    rating: float | None = None  # a league policy's newest rated version's


@dataclass(frozen=True)
class PoolSnapshot:
    """A scheduled pool's usage (`PoolUsage`) at the moment of the snapshot."""

    name: str
    busy_fraction: float
    switches: int
    switch_s: float
    resident_s: dict[str, float]  # per policy: seconds its trainer held the pool
    turns: dict[str, int]  # per policy: training turns


@dataclass(frozen=True)
class JobSnapshot:
    state: State
    message: str
    retryable: bool
    attempt: int | None
    policies: list[PolicySnapshot]
    workers: list[Worker]  # the live workflow workers
    last_ckpt_step: int | None
    last_ckpt_location: str | None
    last_request_id: str | None
    ckpt_in_progress: bool
    episodes: int  # episodes finished
    failed: dict[str, int]  # failed episodes by reason
    elapsed_s: float
    pools: list[PoolSnapshot] = field(default_factory=list)  # the scheduled pools, in spec order


def _worker(s: Slot[Actor], version: int | None = None) -> Worker:
    return Worker(
        pod=s.pod or s.name,
        utilisation=s.utilisation,
        in_flight=s.in_flight,
        draining=s.draining,
        drained=s.drained,
        version=version,
    )


def policy_snapshot(run: PolicyRun, fleet: Fleet, total: int) -> PolicySnapshot:
    live = [s for s in fleet.engines[run.name].values() if not s.dead]
    return PolicySnapshot(
        name=run.name,
        step=run.step,
        last_reward=run.last_reward,
        staleness=run.staleness,
        last_ckpt_step=run.last_ckpt_step,
        # A frozen policy is served the model as loaded, version 0, by a shared base's engine too
        # (whose own version is its adapters').
        engines=[_worker(s, 0 if run.served_only else max(s.version, 0)) for s in live],
        backlog=sum(s.queued for s in live),
        evaluation=run.last_eval,
        version_skew=dict(run.version_skew),
        version=run.version,
        restarts=run.restarts,
        trainer_state="done" if run.trainer_state == "training" and run.step >= total else run.trainer_state,
        aborted_requests=sum(s.aborted for s in live),
        freed_tokens=sum(s.freed_tokens for s in live),
        rating=run.rating,
    )


def worker_views(fleet: Fleet) -> list[Worker]:
    return [_worker(w) for w in fleet.workers.values() if not w.dead]


def pool_snapshots(usage: Mapping[str, PoolUsage], now: float) -> list[PoolSnapshot]:
    """Each scheduled pool's usage, its busy fraction as of `now` (the schedulers' clock)."""
    return [
        PoolSnapshot(
            name=name,
            busy_fraction=u.busy_fraction(now),
            switches=u.switches,
            switch_s=u.switch_s,
            resident_s=dict(u.trainer_s),
            turns=dict(u.turns),
        )
        for name, u in usage.items()
    ]


def progress_report(s: JobSnapshot) -> Progress:
    """The `/progress` document (schema in polyrl_operator.api.progress)."""
    return Progress(
        state=s.state,
        message=s.message or None,
        retryable=s.retryable,
        attempt=s.attempt,
        policies=[
            PolicyProgress(
                name=p.name,
                version=p.step if p.version is None else p.version,
                step=p.step,
                restarts=p.restarts,
                trainer_state=p.trainer_state,
                reward_mean=p.last_reward,
                staleness=StalenessStats(mean=p.staleness[0], max=p.staleness[1]),
                backlog=p.backlog,
                engines=p.engines,
                last_checkpoint_step=p.last_ckpt_step,
                evaluation=p.evaluation,
                version_skew=p.version_skew or None,
                rating=p.rating,
            )
            for p in s.policies
        ],
        workflow=WorkflowProgress(backlog=0, workers=s.workers),
        checkpoint=CheckpointProgress(
            last_step=s.last_ckpt_step, last_request_id=s.last_request_id, in_progress=s.ckpt_in_progress
        ),
        pools=[
            PoolProgress(
                name=q.name,
                busy_fraction=q.busy_fraction,
                switches=q.switches,
                switch_seconds=q.switch_s,
                resident_seconds=q.resident_s,
                turns=q.turns,
            )
            for q in s.pools
        ],
    )


@dataclass
class RunSummary:
    """A finished run. The first and last rewards and successes are the job's metrics series' (one
    value per policy, None before its first step): a resumed run keeps the first run's first ones."""

    state: str
    message: str
    steps: dict[str, int]
    first_reward: dict[str, float | None]
    last_reward: dict[str, float | None]
    wall_s: float
    episodes: int
    failed: dict[str, int]
    dropped: dict[str, dict[str, int]]
    checkpoint: str | None
    records: list[StepRecord] = field(default_factory=list)
    buffers: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per policy: samples produced, consumed (acknowledged), redelivered, buffered, leased."""
    first_success: dict[str, float | None] = field(default_factory=dict)
    last_success: dict[str, float | None] = field(default_factory=dict)
    startup: dict[str, float] = field(default_factory=dict)
    """Seconds each start-up phase took (metrics.StartupPhases), in the order they ran."""
    aborted: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per policy: engine requests aborted because their episode timed out or was cancelled
    (`requests`) and the tokens they did not generate (`freed_tokens`), by its live engines."""


async def run_summary(
    s: JobSnapshot,
    records: list[StepRecord],
    buffer: BufferClient | None,
    ends: SeriesEnds,
    startup: dict[str, float],
) -> RunSummary:
    """What a finished run reports: counters, rewards (`ends`: the series' first and last), every
    step record of this run, the buffers' accounting and the start-up phases' durations."""
    dropped: dict[str, dict[str, int]] = {}
    buffers: dict[str, dict[str, int]] = {}
    if buffer is not None:
        try:
            stats = await buffer.stats()
            dropped = {n: dict(st.dropped) for n, st in stats.items()}
            buffers = {
                n: {k: getattr(st, k) for k in ("produced", "consumed", "redelivered", "buffered", "leased")}
                for n, st in stats.items()
            }
        except Exception as e:  # a buffer actor that is gone leaves the counters empty, not the run
            log.warning(
                "summary.buffer_stats_unavailable", error=str(e).splitlines()[0] if str(e) else repr(e)
            )
    names = [p.name for p in s.policies]
    return RunSummary(
        state=s.state,
        message=s.message,
        steps={p.name: p.step for p in s.policies},
        first_reward={n: ends.first_of(n, "reward_mean") for n in names},
        last_reward={n: ends.last_of(n, "reward_mean") for n in names},
        first_success={n: ends.first_of(n, "success_mean") for n in names},
        last_success={n: ends.last_of(n, "success_mean") for n in names},
        startup=dict(startup),
        wall_s=s.elapsed_s,
        episodes=s.episodes,
        failed=s.failed,
        dropped=dropped,
        checkpoint=s.last_ckpt_location,
        records=list(records),
        buffers=buffers,
        aborted={
            p.name: {"requests": p.aborted_requests, "freed_tokens": p.freed_tokens} for p in s.policies
        },
    )


def actor_counts(spec: RLJobSpec, colocated: int) -> str:
    """The actors a job starts, in words (its engines, `colocated` of them in a trainer's process)."""
    engines = sum(
        spec.rollout_placement(p).min_replicas for p in spec.policies if not spec.shared_base(p.name)
    )
    engines += sum(spec.pool(b.pool).replicas.min for b in spec.shared_bases())
    ranks = sum(spec.trainer_placement(p).trainer_world for p in spec.policies)

    def n(count: int, what: str) -> str:
        return f"{count} {what}{'' if count == 1 else 's'}"

    together = (
        f" ({colocated} in {'its' if colocated == 1 else 'their'} trainer's process)" if colocated else ""
    )
    return f"{n(engines, 'engine')}{together}, {n(ranks, 'trainer rank')}, {n(spec.workflow.replicas.min, 'workflow worker')}"
