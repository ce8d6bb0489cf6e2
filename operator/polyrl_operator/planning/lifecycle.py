"""Lifecycle decisions: has the job finished, must it restart, may it run (Kueue), has it run out of
time, and when does a finished job go. Each is a pure function of the job and what is observed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from polyrl_operator import naming
from polyrl_operator.api import RLJob, Scheduling
from polyrl_operator.api.progress import Progress
from polyrl_operator.observed import Child
from polyrl_operator.planning.conditions import parse_time
from polyrl_operator.planning.types import AdmissionState, Event
from polyrl_operator.roles import pod_traits


@dataclass(frozen=True)
class Verdict:
    """The job finished (Succeeded or Failed) or its training roles must restart."""

    kind: Literal["Succeeded", "Failed", "restart"]
    reason: str
    message: str


def queue_name(job: RLJob, labels: dict[str, str]) -> str | None:
    """The Kueue LocalQueue: ``spec.scheduling.queueName``, else the ``kueue.x-k8s.io/queue-name``
    label (Kueue's own convention for jobs); the spec wins when both are set."""
    if job.spec.scheduling is not None and job.spec.scheduling.queue_name:
        return job.spec.scheduling.queue_name
    return labels.get(naming.LABEL_KUEUE_QUEUE) or None


def with_queue(job: RLJob, labels: dict[str, str]) -> RLJob:
    """``job`` with the queue named by its label written into ``spec.scheduling`` (where the checks
    and the Workload builder read it); unchanged when the spec names one or there is no label."""
    queue = queue_name(job, labels)
    scheduling = job.spec.scheduling
    if queue is None or (scheduling is not None and scheduling.queue_name == queue):
        return job
    filled = (scheduling or Scheduling()).model_copy(update={"queue_name": queue})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"scheduling": filled})})


def _restarts_job(job: RLJob, pod: Child) -> bool:
    """Whether the pod's failure restarts the job: it belongs to a restart attempt (a pool pod:
    it hosts a trainer) and is not replaced alone (a trainer's own pod is: ``plan_pods``)."""
    traits = pod_traits(job, pod.role, pod.owner, pod.index)
    return traits is not None and traits.restarts_job and not traits.replaced_alone_on_failure


def terminal_verdict(
    job: RLJob,
    progress: Progress | None,
    coordinator: Child | None,
    pods: list[Child],
    restarts: int,
) -> Verdict | None:
    """Succeeded, Failed or restart when the observations say so; None while the job runs.

    A restart is the coordinator's failure (its pod, or its report), or a failed pool pod hosting
    a trainer. A failed trainer pod of its own is no verdict: that policy's trainer restarts alone
    (``plan_pods`` replaces the pod; the runtime counts its restarts against the policy's limit and
    says in its report what follows when they run out: the policy frozen, or the job failed)."""
    if (progress is not None and progress.state == "done") or (
        coordinator is not None and coordinator.phase == "Succeeded"
    ):
        detail = progress.message if progress is not None and progress.message else "training finished"
        return Verdict("Succeeded", "Succeeded", detail)
    if progress is not None and progress.state == "failed" and not progress.retryable:
        return Verdict(
            "Failed", "RuntimeFailed", progress.message or "the coordinator reported a fatal error"
        )
    failed = sorted(
        (
            p
            for p in pods
            if _restarts_job(job, p) and p.phase == "Failed" and p.attempt == restarts and not p.deleting
        ),
        key=lambda p: p.name,
    )
    if progress is not None and progress.state == "failed" and not failed and coordinator is not None:
        failed = [coordinator]
    if not failed:
        return None
    first = failed[0]
    why = f"pod {first.name} failed: {first.failure or (progress.message if progress else None) or 'failed'}"
    limit = job.spec.failure_policy.max_restarts
    if restarts >= limit:
        return Verdict("Failed", "RestartLimitExceeded", f"{why}; restart limit {limit} reached")
    return Verdict(
        "restart",
        "Restarting",
        f"{why}; restarting the training roles from the last checkpoint ({restarts + 1}/{limit})",
    )


def deadline_exceeded(job: RLJob, start_time: str | None, now: datetime) -> str | None:
    """Why the job is out of time (``spec.activeDeadlineSeconds`` since ``status.startTime``), or
    None. The clock starts once, when the job first ran, so restarts and suspensions count too."""
    limit = job.spec.active_deadline_seconds
    started = parse_time(start_time)
    if limit is None or started is None:
        return None
    if (now - started).total_seconds() < limit:
        return None
    return f"the job ran longer than activeDeadlineSeconds ({limit}s since {start_time})"


def deadline_wait(job: RLJob, start_time: str | None, now: datetime) -> float | None:
    """Seconds until the deadline passes (to look again then), or None without a deadline."""
    limit = job.spec.active_deadline_seconds
    started = parse_time(start_time)
    if limit is None or started is None:
        return None
    return max((started + timedelta(seconds=limit) - now).total_seconds(), 0.0)


def workload_admission(workload: Child | None) -> AdmissionState:
    """Kueue's verdict from a Workload's status as Kueue writes it."""
    if workload is None:
        return AdmissionState(False, "WorkloadCreating", "creating the Kueue Workload")
    st = workload.workload_status or {}
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    evicted = conds.get("Evicted") or {}
    if evicted.get("status") == "True":
        message = str(evicted.get("message") or evicted.get("reason") or "evicted by Kueue")
        return AdmissionState(False, "Evicted", message)
    admitted = (conds.get("Admitted") or {}).get("status") == "True"
    if admitted and st.get("admission"):
        cq = (st.get("admission") or {}).get("clusterQueue", "")
        return AdmissionState(True, "Admitted", f"admitted by ClusterQueue {cq}")
    pending = conds.get("QuotaReserved") or {}
    return AdmissionState(
        False, "Pending", str(pending.get("message") or "waiting for Kueue to admit the Workload")
    )


NO_QUEUE = AdmissionState(
    True, "NoQueue", f"no scheduling.queueName or {naming.LABEL_KUEUE_QUEUE} label: pods are created directly"
)


def ttl_expiry(
    job: RLJob, completion_time: str | None, now: datetime
) -> tuple[bool, float | None, Event | None]:
    """(delete now, seconds to wait, event) for a finished job with ``ttlSecondsAfterFinished``."""
    ttl = job.spec.ttl_seconds_after_finished
    done_at = parse_time(completion_time)
    if ttl is None or done_at is None:
        return False, None, None
    expires = done_at + timedelta(seconds=ttl)
    if now >= expires:
        return True, None, Event("Normal", "Expired", f"deleting the job {ttl}s after it finished")
    return False, (expires - now).total_seconds(), None
