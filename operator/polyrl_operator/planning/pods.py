"""The pod plan: which role pods must exist, which drain, which go; a value, like every step.

Scale-in drains the highest index first (annotation, then delete once /progress reports it drained
or the drain times out), so pod names stay dense (0..n-1) and no episode in flight is lost. A pool
scales like a rollout fleet, on the backlog of all the rollouts placed on it; its pods past the
minimum host rollout engines only, so draining one never stops a trainer.
Stopping for a suspension, a Kueue eviction or an exceeded deadline first asks the coordinator for a
checkpoint (annotation on its pod) and waits for it, or for the checkpoint timeout, before the pods
are deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from polyrl_operator import naming
from polyrl_operator.api import RLJob, RLJobStatus
from polyrl_operator.api.progress import Worker
from polyrl_operator.autoscale import ScaleState, Signals, decide
from polyrl_operator.builders import JobRef, PodRequest, build_pod
from polyrl_operator.builders.common import Manifest
from polyrl_operator.builders.workload import Admission
from polyrl_operator.observed import Child, Observed
from polyrl_operator.planning.conditions import parse_time, rfc3339
from polyrl_operator.planning.types import Actions, Event, JobMemory, Key, PodPlan, RoleKey, combine
from polyrl_operator.pod_contract import ANNOTATION_CHECKPOINT_REQUEST, ANNOTATION_DRAIN
from polyrl_operator.roles import RoleSlot, RoleTraits, role_slots
from polyrl_operator.settings import OperatorSettings

CHECKPOINT_FIRST = ("Suspended", "Evicted", "DeadlineExceeded")
"""Stop reasons that checkpoint before deleting pods (the others have no training to save)."""


def role_keys(job: RLJob) -> list[RoleKey]:
    """The roles the pod plan counts: every role slot, then every policy's role placed on a pool
    (counted on its pool's pods, see ``_pooled_counts``)."""
    slots = role_slots(job)
    return [(s.owner or "", s.role) for s in slots] + [(r.policy, r.role) for s in slots for r in s.placed]


def empty_pod_plan(job: RLJob) -> PodPlan:
    """No pod wanted: every role at 0 desired, 0 ready."""
    keys = role_keys(job)
    return PodPlan(desired=dict.fromkeys(keys, 0), ready=dict.fromkeys(keys, 0))


@dataclass(frozen=True)
class PodInputs:
    job: RLJob
    ref: JobRef
    settings: OperatorSettings
    observed: Observed
    pods: list[Child]
    restarts: int
    old: RLJobStatus
    memory: JobMemory
    now: datetime


def _old_desired(old: RLJobStatus, slot: RoleSlot) -> int | None:
    """The count the autoscaler last decided for an elastic slot, as status recorded it."""
    if slot.traits.per_pool:
        pool = next((q for q in old.pools or [] if q.name == slot.pool), None)
        value = pool.desired if pool else None
    elif slot.traits.per_policy:
        entry = next((p for p in old.policies or [] if p.name == slot.policy), None)
        counts = None if entry is None else (entry.rollout if slot.role == "rollout" else entry.trainer)
        value = counts.desired if counts else None
    else:
        value = old.workflow.desired if old.workflow else None
    return value if value else None


def _rollout_policies(slot: RoleSlot) -> list[str]:
    """The policies whose engines run on the slot's pods (a rollout's own, or those on a pool)."""
    if slot.traits.per_pool:
        return [r.policy for r in slot.placed if r.role == "rollout"]
    return [slot.policy] if slot.policy else []


def _work(observed: Observed, slot: RoleSlot) -> tuple[int, list[Worker]] | None:
    """(backlog, workers) of an elastic slot from /progress: the workflow's episodes, a rollout's
    generation requests, or for a pool those of every rollout placed on it added up (each of its
    pods runs one engine of each). None when the report does not cover the slot."""
    progress = observed.progress
    if progress is None:
        return None
    policies = _rollout_policies(slot)
    if not policies:
        if slot.traits.per_policy or slot.traits.per_pool:
            return None
        return progress.workflow.backlog, list(progress.workflow.workers)
    entries = [progress.policy(name) for name in policies]
    if any(e is None for e in entries):
        return None
    return sum(e.backlog for e in entries if e), [w for e in entries if e for w in e.engines]


def _signals(observed: Observed, slot: RoleSlot, ready: int) -> Signals | None:
    progress = observed.progress
    if progress is None or progress.state not in ("running", "checkpointing"):
        return None
    work = _work(observed, slot)
    if work is None:
        return None
    backlog, workers = work
    active = [w for w in workers if not w.draining]
    util = sum(w.utilisation for w in active) / len(active) if active else 0.0
    return Signals(backlog=backlog, utilisation=util, ready=ready)


def _pod_drained(observed: Observed, slot: RoleSlot, pod: str) -> bool:
    """Every worker the report places on ``pod`` (one engine per rollout on a pool pod) drained."""
    work = _work(observed, slot)
    on_pod = [w for w in work[1] if w.pod == pod] if work is not None else []
    return bool(on_pod) and all(w.drained for w in on_pod)


def _of_slot(pod: Child, slot: RoleSlot) -> bool:
    return pod.role == slot.role and pod.owner == (slot.owner or "")


def _ready_count(inputs: PodInputs, slot: RoleSlot, limit: int) -> int:
    return sum(
        1
        for p in inputs.pods
        if _of_slot(p, slot)
        and p.index < limit
        and p.ready
        and not p.deleting
        and (not slot.traits_at(p.index).restarts_job or p.attempt == inputs.restarts)
    )


def _pooled_counts(
    inputs: PodInputs, slot: RoleSlot, pods: int
) -> tuple[dict[RoleKey, int], dict[RoleKey, int]]:
    """(desired, ready) of each role placed on a pool that runs ``pods`` pods: a rollout runs an
    engine on each of them, a trainer ranks on the first ``min_replicas``."""
    desired: dict[RoleKey, int] = {}
    ready: dict[RoleKey, int] = {}
    for placed in slot.placed:
        count = pods if placed.role == "rollout" else min(slot.min_replicas, pods)
        desired[(placed.policy, placed.role)] = count
        ready[(placed.policy, placed.role)] = _ready_count(inputs, slot, count)
    return desired, ready


def plan_pods(inputs: PodInputs, admission: Admission | None) -> PodPlan:
    """The pods of a job that should run now, with the autoscaler's decisions and drains."""
    job, settings, now = inputs.job, inputs.settings, inputs.now
    priority = inputs.observed.resolved_priority
    by_name = {p.name: p for p in inputs.pods}
    desired: dict[RoleKey, int] = {}
    scale: dict[str, ScaleState] = dict(inputs.memory.scale)
    scaled: list[tuple[str, str, int, int]] = []
    parts: list[Actions] = []

    # Fixed roles: their spec's count (one coordinator, trainer.replicas trainers). Elastic roles
    # (pools included): the last decision recorded in status (never spec), moved by the autoscaler.
    slots = role_slots(job)
    for slot in slots:
        owner, role = slot.owner or "", slot.role
        if not slot.traits.elastic:
            desired[(owner, role)] = slot.min_replicas
            continue
        lo, hi = slot.min_replicas, slot.max_replicas
        podset = naming.podset(role, slot.owner)
        if admission is not None and podset in admission.counts:
            hi = max(lo, min(slot.max_replicas, admission.counts[podset]))
        current = _old_desired(inputs.old, slot) or lo
        key = f"{owner}/{role}"
        decision = decide(
            current,
            lo,
            hi,
            signals=_signals(inputs.observed, slot, _ready_count(inputs, slot, current)),
            state=scale.get(key, ScaleState()),
            now=now.timestamp(),
            params=settings.autoscale,
        )
        scale[key] = decision.state
        if decision.desired != current:
            what = _describe(slot)
            scaled.append((owner, role, current, decision.desired))
            message = f"{what}: {current} -> {decision.desired} replicas ({decision.reason})"
            parts.append(Actions(events=(Event("Normal", "Scaled", message),)))
        desired[(owner, role)] = decision.desired

    pods: dict[Key, Manifest] = {}
    required: set[str] = set()
    ready: dict[RoleKey, int] = {}
    pooled_desired: dict[RoleKey, int] = {}
    missing_required = 0
    waiting = 0
    unschedulable: list[str] = []
    for slot in slots:
        owner, role = slot.owner or "", slot.role
        count, minimum = desired[(owner, role)], slot.min_replicas
        flavor = admission.placement.get(naming.podset(role, slot.owner)) if admission else None
        for i in range(count):
            traits = slot.traits_at(i)
            attempt = inputs.restarts if traits.restarts_job else 0
            request = PodRequest(role, i, slot.policy, attempt, flavor, pool=slot.pool)
            manifest = build_pod(job, inputs.ref, request, settings, priority)
            name = manifest["metadata"]["name"]
            existing = by_name.get(name)
            if i < minimum:
                required.add(name)
                current = (
                    existing is not None
                    and not existing.deleting
                    and existing.spec_hash == manifest["metadata"]["annotations"][naming.ANNOTATION_HASH]
                )
                missing_required += 0 if current else 1
            if existing is not None and existing.unschedulable:
                unschedulable.append(f"{name}: {existing.unschedulable}")
            why = _replacing(slot, traits, attempt, existing)
            if why is not None:
                parts.append(Actions(events=(Event("Warning", "Replacing", why),), requeue_after=1.0))
                continue
            pods[("Pod", name)] = manifest
            if existing is not None and existing.annotation(ANNOTATION_DRAIN):
                undrain = ((ANNOTATION_DRAIN, None), (naming.ANNOTATION_DRAIN_SINCE, None))
                parts.append(Actions(annotate=((name, undrain),)))
        ready[(owner, role)] = _ready_count(inputs, slot, count)
        waiting += max(minimum - ready[(owner, role)], 0)
        if slot.traits.elastic:
            parts.append(_scale_in(inputs, slot, count))
        if slot.placed:
            placed_desired, placed_ready = _pooled_counts(inputs, slot, count)
            pooled_desired |= placed_desired
            ready |= placed_ready

    if unschedulable:
        reason, message = "Unschedulable", "unschedulable: " + "; ".join(sorted(unschedulable)[:3])
    elif missing_required:
        # No count in the message: it would change (and cost a status write) with every pod created.
        reason, message = "Creating", "creating pods"
    else:
        reason, message = "PodsNotReady", f"waiting for {waiting} pods to become ready"
    return PodPlan(
        desired=desired | pooled_desired,
        ready=ready,
        pods=pods,
        required=frozenset(required),
        actions=combine(*parts),
        scale=scale,
        scaled=tuple(scaled),
        all_required_exist=missing_required == 0,
        ready_enough=waiting == 0,
        any_live=bool(inputs.pods),
        wait_message=message,
        not_ready_reason=reason,
    )


def _replacing(slot: RoleSlot, traits: RoleTraits, attempt: int, existing: Child | None) -> str | None:
    """Why ``existing`` is replaced alone (deleted now, created again next round, the job carrying
    on), or None when it is not.

    A finished elastic worker is. So is a failed pod of a role ``replaced_alone_on_failure`` (a
    trainer's own) of the attempt it would be created in again: its label stays, so a later
    restart of the job still recreates it. Any other pod that restarts the job is not: the restart
    (a new attempt) replaces it, and a pod of an earlier attempt goes because its content differs."""
    if existing is None or existing.deleting or not existing.terminated:
        return None
    what = f"pod {existing.name} {existing.phase.lower()}: {existing.failure or 'exited'}"
    if traits.elastic and not traits.restarts_job:
        return f"{what}; replacing it"
    if traits.replaced_alone_on_failure and existing.phase == "Failed" and existing.attempt == attempt:
        return (
            f"{what}; replacing it: the trainer of policy {slot.policy} restarts alone from its "
            "latest checkpoint while the other policies train on"
        )
    return None


def _describe(slot: RoleSlot) -> str:
    """How events name a slot: ``rollout of policy speaker``, ``pool shared``, ``workflow``."""
    if slot.traits.per_pool:
        return f"pool {slot.pool}"
    return f"{slot.role} of policy {slot.policy}" if slot.policy else slot.role


def _scale_in(inputs: PodInputs, slot: RoleSlot, count: int) -> Actions:
    """Pods of an elastic slot with index >= count: drain the busy ones, delete the rest."""
    settings, now = inputs.settings, inputs.now
    parts: list[Actions] = []
    for pod in sorted(inputs.pods, key=lambda p: p.index):
        if not _of_slot(pod, slot) or pod.index < count or pod.deleting:
            continue
        if pod.terminated or not pod.ready:
            continue  # nothing runs on it: it is simply deleted
        since = parse_time(pod.annotation(naming.ANNOTATION_DRAIN_SINCE)) or now
        if _pod_drained(inputs.observed, slot, pod.name):
            parts.append(
                Actions(events=(Event("Normal", "Drained", f"pod {pod.name} drained; deleting it"),))
            )
            continue
        waited = (now - since).total_seconds()
        if waited >= settings.drain_timeout:
            why = f"pod {pod.name} not drained after {settings.drain_timeout:g}s; deleting it"
            parts.append(Actions(events=(Event("Warning", "DrainTimeout", why),)))
            continue
        events: tuple[Event, ...] = ()
        annotate: tuple[tuple[str, tuple[tuple[str, str | None], ...]], ...] = ()
        if pod.annotation(ANNOTATION_DRAIN) != "true":
            values = ((ANNOTATION_DRAIN, "true"), (naming.ANNOTATION_DRAIN_SINCE, rfc3339(now)))
            annotate = ((pod.name, values),)
            events = (Event("Normal", "Draining", f"draining pod {pod.name} before deleting it"),)
        parts.append(
            Actions(
                events=events,
                keep=frozenset({("Pod", pod.name)}),
                annotate=annotate,
                requeue_after=min(settings.progress_interval, settings.drain_timeout - waited),
            )
        )
    return combine(*parts)


def plan_stop(inputs: PodInputs, stop_reason: str) -> PodPlan:
    """No pod should run: checkpoint first (suspend, eviction, deadline) when a coordinator is up,
    then delete. The wait is bounded by the checkpoint timeout."""
    settings, now, pods = inputs.settings, inputs.now, inputs.pods
    coordinator = next(
        (p for p in pods if p.role == "coordinator" and not p.deleting and p.phase == "Running"), None
    )
    if stop_reason not in CHECKPOINT_FIRST or coordinator is None:
        return replace(empty_pod_plan(inputs.job), any_live=bool(pods), stop_message="deleting pods")
    on_pod = coordinator.annotation(ANNOTATION_CHECKPOINT_REQUEST)
    on_pod_since = coordinator.annotation(naming.ANNOTATION_CHECKPOINT_SINCE)
    asked: list[Actions] = []
    if on_pod is not None and on_pod_since is not None and parse_time(on_pod_since) is not None:
        remembered = (on_pod, on_pod_since)
    else:
        # Not visible on the pod yet: reuse a request made a moment ago (the index may lag our patch).
        earlier = inputs.memory.checkpoint
        if earlier is not None and parse_time(earlier[1]) is not None:
            remembered = earlier
        else:
            remembered = (f"{stop_reason.lower()}-{now.strftime('%Y%m%dT%H%M%SZ')}", rfc3339(now))
            why = f"asked the coordinator to checkpoint ({remembered[0]}) before deleting pods"
            asked.append(Actions(events=(Event("Normal", "CheckpointRequested", why),)))
        values = (
            (ANNOTATION_CHECKPOINT_REQUEST, remembered[0]),
            (naming.ANNOTATION_CHECKPOINT_SINCE, remembered[1]),
        )
        asked.append(Actions(annotate=((coordinator.name, values),)))
    request = remembered[0]
    since = parse_time(remembered[1]) or now
    progress = inputs.observed.progress
    waited = (now - since).total_seconds()
    if (
        progress is not None
        and progress.checkpoint.last_request_id == request
        and not progress.checkpoint.in_progress
    ):
        why = f"checkpoint {request} done at step {progress.checkpoint.last_step}; deleting pods"
        done = Actions(events=(Event("Normal", "Checkpointed", why),))
        return _stopping(inputs, "deleting pods", combine(*asked, done), remembered)
    if waited >= settings.checkpoint_timeout:
        why = f"no checkpoint after {settings.checkpoint_timeout:g}s; deleting pods anyway"
        late = Actions(events=(Event("Warning", "CheckpointTimeout", why),))
        return _stopping(inputs, "deleting pods", combine(*asked, late), remembered)
    hold = Actions(
        keep=frozenset(("Pod", p.name) for p in pods if not p.deleting),
        requeue_after=min(settings.progress_interval, settings.checkpoint_timeout - waited),
    )
    message = f"checkpointing before deleting pods (request {request})"
    return replace(_stopping(inputs, message, combine(*asked, hold), remembered), checkpointing=True)


def _stopping(inputs: PodInputs, message: str, actions: Actions, checkpoint: tuple[str, str]) -> PodPlan:
    return replace(
        empty_pod_plan(inputs.job),
        any_live=True,
        stop_message=message,
        actions=actions,
        checkpoint=checkpoint,
    )
