"""What the driver reports: the `/progress` document the operator polls and the summary of a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from polyrl_operator.api.progress import (
    CheckpointProgress,
    PolicyProgress,
    Progress,
    StalenessStats,
    Worker,
    WorkflowProgress,
)
from polyrl_runtime.coordinator.metrics import StepRecord
from polyrl_runtime.experience.buffer import PolicyStats

if TYPE_CHECKING:
    from polyrl_runtime.coordinator.driver import Driver

log = structlog.get_logger(__name__)


@dataclass
class RunSummary:
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


def progress_report(d: Driver) -> Progress:
    """The `/progress` document (schema in polyrl_operator.api.progress) of a running driver."""
    policies = []
    for name, run in d.runs.items():
        engines = []
        backlog = 0
        if d.fleet is not None:
            for s in d.fleet.engines[name].values():
                if s.dead:
                    continue
                backlog += s.queued
                engines.append(
                    Worker(
                        pod=s.pod or s.name,
                        utilisation=s.utilisation,
                        in_flight=s.in_flight,
                        draining=s.draining,
                        drained=s.drained,
                        version=max(s.version, 0),
                    )
                )
        policies.append(
            PolicyProgress(
                name=name,
                version=run.step,
                step=run.step,
                reward_mean=run.last_reward,
                staleness=StalenessStats(mean=run.staleness[0], max=run.staleness[1]),
                backlog=backlog,
                engines=engines,
                last_checkpoint_step=run.last_ckpt_step,
            )
        )
    workers = []
    if d.fleet is not None:
        workers = [
            Worker(
                pod=w.pod or w.name,
                utilisation=w.utilisation,
                in_flight=w.in_flight,
                draining=w.draining,
                drained=w.drained,
            )
            for w in d.fleet.workers.values()
            if not w.dead
        ]
    return Progress(
        state=d.state,
        message=d.message or None,
        retryable=d.retryable,
        attempt=d.opts.attempt,
        policies=policies,
        workflow=WorkflowProgress(backlog=0, workers=workers),
        checkpoint=CheckpointProgress(
            last_step=d.last_ckpt.step if d.last_ckpt else None,
            last_request_id=d.handled_requests[-1] if d.handled_requests else None,
            in_progress=d.ckpt_in_progress,
        ),
    )


async def run_summary(d: Driver) -> RunSummary:
    """What a finished run reports: counters, rewards, every step record, the buffers' accounting."""
    dropped: dict[str, dict[str, int]] = {}
    buffers: dict[str, dict[str, int]] = {}
    if d.buffer is not None:
        try:
            stats: dict[str, PolicyStats] = await d.buffer.stats.remote()
            dropped = {n: dict(s.dropped) for n, s in stats.items()}
            buffers = {
                n: {k: getattr(s, k) for k in ("produced", "consumed", "redelivered", "buffered", "leased")}
                for n, s in stats.items()
            }
        except Exception as e:  # a buffer actor that is gone leaves the counters empty, not the run
            log.warning(
                "summary.buffer_stats_unavailable", error=str(e).splitlines()[0] if str(e) else repr(e)
            )
    first: dict[str, float | None] = {}
    for r in d.records:
        first.setdefault(r.policy, r.reward_mean)
    return RunSummary(
        state=d.state,
        message=d.message,
        steps={n: r.step for n, r in d.runs.items()},
        first_reward=first,
        last_reward={n: r.last_reward for n, r in d.runs.items()},
        wall_s=d.elapsed(),
        episodes=d.producer.episodes_ok if d.producer else 0,
        failed=dict(d.producer.failures) if d.producer else {},
        dropped=dropped,
        checkpoint=d.last_ckpt.location if d.last_ckpt else None,
        records=list(d.records),
        buffers=buffers,
    )
