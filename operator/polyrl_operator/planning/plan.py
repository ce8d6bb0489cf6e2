"""plan(job, observed) -> Plan: the pure heart of the operator.

Given the RLJob as stored, a snapshot of its children (from the kopf indexes), the coordinator's
/progress and the clock, it returns the exact set of children that should exist, the status to
write and the decisions taken (events). No I/O: the reconciler gathers the inputs and apply executes
the result, so every decision (restart, scale, drain, suspend, admission, deadline, TTL) is
unit-testable.

Level-based: the plan depends only on what is observed now (plus the status the operator wrote
before, which records its own decisions: desired replica counts, restarts and start time). Running
it twice on the same inputs gives the same result, which is why an unchanged job costs no write.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

from pydantic import ValidationError

from polyrl_operator import naming
from polyrl_operator.api import RLJob, RLJobStatus
from polyrl_operator.builders import (
    JobRef,
    build_config_map,
    build_coordinator_service,
    build_headless_service,
    build_network_policies,
    build_secret,
    build_service_account,
    build_workload,
)
from polyrl_operator.builders.common import Manifest
from polyrl_operator.builders.priority import PriorityNotFound
from polyrl_operator.builders.workload import admitted_placement
from polyrl_operator.checks import format_problems, operator_checks, parse_job, queue_label_problems
from polyrl_operator.observed import Observed
from polyrl_operator.planning.conditions import get_condition
from polyrl_operator.planning.lifecycle import (
    NO_QUEUE,
    Verdict,
    deadline_exceeded,
    deadline_wait,
    terminal_verdict,
    ttl_expiry,
    with_queue,
    workload_admission,
)
from polyrl_operator.planning.pods import PodInputs, plan_pods, plan_stop
from polyrl_operator.planning.status import (
    active_status,
    finished_status,
    invalid_status,
    policy_events,
    transition_events,
)
from polyrl_operator.planning.types import (
    Actions,
    AdmissionState,
    Event,
    JobMemory,
    Key,
    Plan,
    PodPlan,
    QuotaRefusal,
    StatusInputs,
    combine,
)
from polyrl_operator.roles import role_slots
from polyrl_operator.settings import OperatorSettings

_STATUS_KEYS = frozenset(f.alias or name for name, f in RLJobStatus.model_fields.items())


def stored_status(body: dict[str, Any]) -> RLJobStatus:
    """The status as last written; fields this version does not know are ignored, and a status
    that does not parse at all reads as a fresh one (it is rewritten from observations)."""
    raw = body.get("status") or {}
    try:
        return RLJobStatus.model_validate({k: v for k, v in raw.items() if k in _STATUS_KEYS}, strict=False)
    except ValidationError:
        return RLJobStatus()


def _keyed(manifests: list[Manifest]) -> dict[Key, Manifest]:
    return {(str(m["kind"]), str(m["metadata"]["name"])): m for m in manifests}


def infrastructure(job: RLJob, ref: JobRef, settings: OperatorSettings) -> dict[Key, Manifest]:
    """ConfigMap, Secret, ServiceAccount, NetworkPolicies and Services: they exist for the job's
    whole life (pods come and go)."""
    manifests = [
        build_config_map(job, ref),
        build_secret(ref, None),
        build_service_account(ref),
        *build_network_policies(ref, settings),
        build_coordinator_service(ref, dashboard=job.spec.coordinator.dashboard),
        *(build_headless_service(ref, s.role, s.owner) for s in role_slots(job) if not s.traits.singleton),
    ]
    return _keyed(manifests)


def plan(
    body: dict[str, Any],
    observed: Observed,
    settings: OperatorSettings,
    now: datetime,
    memory: JobMemory | None = None,
) -> Plan:
    meta = body.get("metadata") or {}
    ref = JobRef(meta.get("name", ""), meta.get("namespace") or "default", meta.get("uid", ""))
    gen = meta.get("generation")
    old = stored_status(body)
    memory = memory or JobMemory()
    # What the last apply reported feeds this plan's status, once: the plan's memory forgets it.
    refusal, memory = memory.quota_refusal, replace(memory, quota_refusal=None)
    finalizers = meta.get("finalizers") or []

    if meta.get("deletionTimestamp"):
        # Explicit cleanup (no garbage collector is assumed): every child goes, then the finalizer.
        if naming.FINALIZER not in finalizers:
            return Plan(ref=ref, status=None, memory=memory)
        if observed.children:
            return Plan(ref=ref, status=None, memory=memory, actions=Actions(requeue_after=1.0))
        return Plan(ref=ref, status=None, memory=memory, finalizer="remove")
    finalizer: Literal["add"] | None = None if naming.FINALIZER in finalizers else "add"

    job, problems = parse_job(body)
    if job is not None:
        labels = dict(meta.get("labels") or {})
        problems += queue_label_problems(job, labels, settings)
        if settings.kueue.enabled:
            job = with_queue(job, labels)
        problems += operator_checks(job, settings)
    why_invalid = format_problems(problems) if job is None or problems else None
    if why_invalid is None and memory.rejected is not None:
        if memory.rejected[0] == gen:
            why_invalid = memory.rejected[1]
        else:
            memory = replace(memory, rejected=None)  # a new spec: try it
    if job is None or why_invalid is not None:
        status = invalid_status(old, why_invalid or "", gen, now)
        return Plan(
            ref=ref,
            status=status,
            actions=Actions(events=transition_events(old, status)),
            finalizer=finalizer,
            memory=memory,
        )

    failed = get_condition(old, "Failed")
    terminal = old.phase == "Succeeded" or (
        old.phase == "Failed" and (failed is None or failed.reason != "InvalidSpec")
    )
    restarts = old.restarts
    if observed.progress is not None and observed.progress.attempt not in (None, restarts):
        # The coordinator of an earlier attempt, still answering while its pod goes: its "failed"
        # was already counted, and read as the new attempt's it would restart the job again.
        observed = replace(observed, progress=None)
    own = [c for c in observed.children if c.owner_uid == ref.uid]
    pods = [c for c in own if c.kind == "Pod"]
    coordinator = next((c for c in pods if c.role == "coordinator" and not c.deleting), None)
    desired = infrastructure(job, ref, settings)
    queue = job.spec.scheduling.queue_name if job.spec.scheduling else None
    admission_state = NO_QUEUE
    placement = None
    workload_manifest: dict[Key, Manifest] = {}
    if queue and isinstance(observed.priority, PriorityNotFound):
        # No Workload without its priority: Kueue would admit it at the wrong one. The job waits,
        # saying which field names what; the resync looks the class up again.
        admission_state = AdmissionState(False, "PriorityNotFound", observed.priority.message)
    elif queue:
        # While the job is live its Workload holds its quota; a finished job's goes (quota freed).
        priority = observed.resolved_priority
        workload_manifest = _keyed(
            [build_workload(job, ref, settings, active=not job.spec.suspend, priority=priority)]
        )
        workload = next((c for c in own if c.kind == "Workload"), None)
        admission_state = workload_admission(workload)
        if admission_state.admitted and workload is not None:
            placement = admitted_placement({"status": workload.workload_status}, observed.flavors)
    inputs = PodInputs(job, ref, settings, observed, pods, restarts, old, memory, now)

    verdict: Verdict | None = None
    decided: list[Actions] = []
    if not terminal:
        verdict = terminal_verdict(job, observed.progress, coordinator, pods, restarts)
        if verdict is not None and verdict.kind == "restart":
            restarts += 1
            inputs = replace(inputs, restarts=restarts)
            decided.append(Actions(events=(Event("Warning", "Restarting", verdict.message),)))
            verdict = None
        if verdict is None:
            late = deadline_exceeded(job, old.start_time, now)
            if late is not None:
                stopping = plan_stop(inputs, "DeadlineExceeded")
                decided.append(stopping.actions)
                if stopping.checkpointing:
                    frame = _Frame(ref, gen, finalizer, memory, desired | workload_manifest, refusal)
                    return _live(
                        frame, inputs, stopping, "DeadlineExceeded", decided, admission=admission_state
                    )
                verdict = Verdict("Failed", "DeadlineExceeded", late)
        if verdict is not None:
            terminal = True
            kind: Literal["Normal", "Warning"] = "Normal" if verdict.kind == "Succeeded" else "Warning"
            decided.append(Actions(events=(Event(kind, verdict.reason, verdict.message),)))

    if terminal:
        return _finished(_Frame(ref, gen, finalizer, memory, desired), inputs, verdict, decided)

    retry_at = memory.quota_retry_at
    quota_blocked = not queue and retry_at is not None and now.timestamp() < retry_at
    if quota_blocked and retry_at is not None:
        decided.append(Actions(requeue_after=retry_at - now.timestamp()))
    stop_reason: str | None = None
    if job.spec.suspend:
        stop_reason = "Suspended"
    elif admission_state.reason == "Evicted":
        stop_reason = "Evicted"
    elif not admission_state.admitted:
        stop_reason = "NotAdmitted"
    elif quota_blocked:
        stop_reason = "QuotaExceeded"
    if stop_reason is None:
        pod_plan = plan_pods(inputs, placement)
        wait = deadline_wait(job, old.start_time, now)
        if wait is not None:
            decided.append(Actions(requeue_after=wait))
    else:
        pod_plan = plan_stop(inputs, stop_reason)
    frame = _Frame(ref, gen, finalizer, memory, desired | workload_manifest, refusal)
    return _live(frame, inputs, pod_plan, stop_reason, decided, admission=admission_state)


@dataclass(frozen=True)
class _Frame:
    """What every kind of plan of one job carries."""

    ref: JobRef
    generation: int | None
    finalizer: Literal["add", "remove"] | None
    memory: JobMemory
    desired: dict[Key, Manifest]
    refusal: QuotaRefusal | None = None
    """The quota refusal the last apply reported (only a live plan's status reports it)."""


def _live(
    frame: _Frame,
    inputs: PodInputs,
    pod_plan: PodPlan,
    stop_reason: str | None,
    decided: list[Actions],
    *,
    admission: AdmissionState = NO_QUEUE,
) -> Plan:
    """A job that may run: its pods (or their orderly stop) and its live status."""
    memory = replace(
        frame.memory,
        scale=pod_plan.scale if stop_reason is None else frame.memory.scale,
        checkpoint=pod_plan.checkpoint if stop_reason is not None else None,
    )
    status_inputs = StatusInputs(
        job=inputs.job,
        old=inputs.old,
        generation=frame.generation,
        now=inputs.now,
        progress=inputs.observed.progress,
        restarts=inputs.restarts,
        pods=pod_plan,
        stop_reason=stop_reason,
        admission=admission,
        quota_message=memory.quota_message,
        # A refusal is news only to a plan that still wants pods, or waits for quota: a job being
        # suspended, evicted or not admitted says that instead.
        refusal=frame.refusal if stop_reason in (None, "QuotaExceeded") else None,
    )
    status = active_status(status_inputs)
    transitions = Actions(
        events=transition_events(inputs.old, status) + policy_events(inputs.job, inputs.old, status)
    )
    return Plan(
        ref=frame.ref,
        status=status,
        desired=frame.desired | pod_plan.pods,
        actions=combine(*decided, pod_plan.actions, transitions),
        required_pods=pod_plan.required,
        finalizer=frame.finalizer,
        memory=memory,
        scaled=pod_plan.scaled,
        running=stop_reason is None,
    )


def _finished(frame: _Frame, inputs: PodInputs, verdict: Verdict | None, decided: list[Actions]) -> Plan:
    """Succeeded or Failed: free the hardware at once (running pods go, the Workload goes so Kueue
    releases the quota), keep finished pods for their logs, and delete the job after its TTL."""
    job, now = inputs.job, inputs.now
    status = finished_status(
        job,
        inputs.old,
        verdict=verdict,
        progress=inputs.observed.progress,
        generation=frame.generation,
        now=now,
    )
    succeeded = status.phase == "Succeeded"
    keep = frozenset(
        ("Pod", p.name) for p in inputs.pods if p.terminated or (succeeded and p.role == "coordinator")
    )
    expired, wait, event = ttl_expiry(job, status.completion_time, now)
    ttl = Actions(events=(event,) if event else (), requeue_after=wait)
    befell = Actions(events=policy_events(job, inputs.old, status))
    return Plan(
        ref=frame.ref,
        status=status.model_copy(update={"restarts": inputs.restarts}),
        desired=frame.desired,
        actions=combine(*decided, befell, Actions(keep=keep), ttl),
        finalizer=frame.finalizer,
        delete_job=expired,
        memory=frame.memory,
    )
