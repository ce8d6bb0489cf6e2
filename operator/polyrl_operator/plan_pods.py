"""The pod part of the plan: which role pods must exist, which drain, which go.

Separate from plan.py only to keep each module readable; it is equally pure. Scale-in drains the
highest index first (annotation, then delete once /progress reports it drained or the drain times
out), so pod names stay dense (0..n-1) and no episode in flight is lost. Suspension and Kueue
eviction first ask the coordinator for a checkpoint (annotation on its pod) and wait for it, or for
the checkpoint timeout, before deleting pods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from polyrl_operator import naming
from polyrl_operator.api import RLJob
from polyrl_operator.autoscale import ScaleState, Signals, decide
from polyrl_operator.builders import JobRef, PodRequest, build_pod
from polyrl_operator.builders.pods import pod_name
from polyrl_operator.builders.workload import Admission
from polyrl_operator.naming import Role
from polyrl_operator.observed import Child, Observed
from polyrl_operator.settings import OperatorSettings
from polyrl_operator.status import parse_time, rfc3339

if TYPE_CHECKING:
    from polyrl_operator.plan import Plan

RoleKey = tuple[str, Role]
"""(policy or "", role)."""


@dataclass
class PodPlan:
    desired: dict[RoleKey, int] = field(default_factory=dict)
    ready: dict[RoleKey, int] = field(default_factory=dict)
    all_required_exist: bool = False
    ready_enough: bool = False
    any_live: bool = False
    """Some pod of the job still exists (a suspension is complete when none does)."""
    stop_message: str = ""
    wait_message: str = ""
    not_ready_reason: str = "Creating"

    @classmethod
    def empty(cls, job: RLJob) -> PodPlan:
        keys: list[RoleKey] = [("", "coordinator"), ("", "workflow")]
        for p in job.spec.policies:
            keys += [(p.name, "rollout"), (p.name, "trainer")]
        return cls(desired=dict.fromkeys(keys, 0), ready=dict.fromkeys(keys, 0))


def _old_desired(old: dict[str, Any], policy: str, role: str) -> int | None:
    if not policy:
        value = (old.get("workflow") or {}).get("desired")
    else:
        entry: dict[str, Any] = next((p for p in old.get("policies") or [] if p.get("name") == policy), {})
        value = (entry.get(role) or {}).get("desired")
    return value if isinstance(value, int) and value > 0 else None


def _signals(observed: Observed, policy: str, ready: int) -> Signals | None:
    progress = observed.progress
    if progress is None or progress.state not in ("running", "checkpointing"):
        return None
    if policy:
        entry = progress.policy(policy)
        if entry is None:
            return None
        backlog, workers = entry.backlog, entry.engines
    else:
        backlog, workers = progress.workflow.backlog, progress.workflow.workers
    active = [w for w in workers if not w.draining]
    util = sum(w.utilisation for w in active) / len(active) if active else 0.0
    return Signals(backlog=backlog, utilisation=util, ready=ready)


def _worker_drained(observed: Observed, policy: str, pod: str) -> bool:
    progress = observed.progress
    if progress is None:
        return False
    if policy:
        entry = progress.policy(policy)
        workers = entry.engines if entry else []
    else:
        workers = progress.workflow.workers
    return any(w.pod == pod and w.drained for w in workers)


def plan_pods(
    out: Plan,
    job: RLJob,
    *,
    ref: JobRef,
    settings: OperatorSettings,
    observed: Observed,
    pods: list[Child],
    restarts: int,
    stop_reason: str | None,
    admission: Admission | None,
    old: dict[str, Any],
    now: datetime,
) -> PodPlan:
    from polyrl_operator.plan import Event

    result = PodPlan.empty(job)
    result.any_live = bool(pods)
    by_name = {p.name: p for p in pods}
    if stop_reason is not None:
        _stop(out, observed, pods=pods, stop_reason=stop_reason, settings=settings, now=now, result=result)
        return result

    # How many pods each role wants. Fixed roles: one coordinator, trainer.replicas trainers.
    # Elastic roles: the last decision recorded in status (never spec), moved by the autoscaler.
    def ready_of(policy: str, role: Role, limit: int) -> int:
        return sum(
            1
            for p in pods
            if p.role == role
            and (p.policy or "") == policy
            and p.index < limit
            and p.ready
            and not p.deleting
            and (role not in ("coordinator", "trainer") or p.attempt == restarts)
        )

    elastic: list[tuple[str, Role, int, int]] = [
        ("", "workflow", job.spec.workflow.replicas.min, job.spec.workflow.replicas.max)
    ]
    for p in job.spec.policies:
        elastic.append((p.name, "rollout", p.rollout.replicas.min, p.rollout.replicas.max))
    for policy, role, lo, spec_hi in elastic:
        podset = naming.podset(role, policy or None)
        hi = spec_hi
        if admission is not None and podset in admission.counts:
            hi = max(lo, min(spec_hi, admission.counts[podset]))
        current = _old_desired(old, policy, role) or lo
        key = f"{policy}/{role}"
        ready = ready_of(policy, role, current)
        decision = decide(
            current,
            lo,
            hi,
            signals=_signals(observed, policy, ready),
            state=out.memory.scale.get(key, ScaleState()),
            now=now.timestamp(),
            params=settings.autoscale,
        )
        out.memory.scale[key] = decision.state
        if decision.desired != current:
            what = f"rollout of policy {policy}" if policy else "workflow"
            out.scaled.append((policy, role, current, decision.desired))
            out.events.append(
                Event(
                    "Normal",
                    "Scaled",
                    f"{what}: {current} -> {decision.desired} replicas ({decision.reason})",
                )
            )
        result.desired[(policy, role)] = decision.desired
    result.desired[("", "coordinator")] = 1
    for p in job.spec.policies:
        result.desired[(p.name, "trainer")] = p.trainer.replicas

    wanted: list[tuple[str, Role, int, int]] = [("", "coordinator", 1, 1)]
    wanted.append(("", "workflow", result.desired[("", "workflow")], job.spec.workflow.replicas.min))
    for p in job.spec.policies:
        wanted.append((p.name, "rollout", result.desired[(p.name, "rollout")], p.rollout.replicas.min))
        wanted.append((p.name, "trainer", p.trainer.replicas, p.trainer.replicas))

    missing_required = 0
    unschedulable: list[str] = []
    for policy, role, count, required in wanted:
        flavor = admission.placement.get(naming.podset(role, policy or None)) if admission else None
        attempt = restarts if role in ("coordinator", "trainer") else 0
        for i in range(count):
            req = PodRequest(role, i, policy or None, attempt, flavor)
            manifest = build_pod(job, ref, req, settings)
            name = manifest["metadata"]["name"]
            existing = by_name.get(name)
            if i < required:
                out.required_pods.add(name)
                current = (
                    existing is not None
                    and not existing.deleting
                    and existing.spec_hash == manifest["metadata"]["annotations"][naming.ANNOTATION_HASH]
                )
                missing_required += 0 if current else 1
            if existing is not None and existing.unschedulable:
                unschedulable.append(f"{name}: {existing.unschedulable}")
            if (
                existing is not None
                and existing.terminated
                and role in ("workflow", "rollout")
                and not existing.deleting
            ):
                # A finished worker is replaced: deleted now, created again next round.
                out.events.append(
                    Event(
                        "Warning",
                        "Replacing",
                        f"pod {name} {existing.phase.lower()}: {existing.failure or 'exited'}; replacing it",
                    )
                )
                out.requeue(1.0)
                continue
            out.desired[("Pod", name)] = manifest
            if existing is not None and existing.annotation(naming.ANNOTATION_DRAIN):
                _annotate(out, name, {naming.ANNOTATION_DRAIN: None, naming.ANNOTATION_DRAIN_SINCE: None})
        result.ready[(policy, role)] = ready_of(policy, role, count)
        if role in ("workflow", "rollout"):
            _scale_in(
                out, observed, pods=pods, policy=policy, role=role, count=count, settings=settings, now=now
            )

    result.all_required_exist = missing_required == 0
    result.ready_enough = all(result.ready[(p, r)] >= req for p, r, _, req in wanted)
    if unschedulable:
        result.not_ready_reason = "Unschedulable"
        result.wait_message = "unschedulable: " + "; ".join(sorted(unschedulable)[:3])
    elif not result.all_required_exist:
        result.not_ready_reason = "Creating"
        # No count in the message: it would change (and cost a status write) with every pod created.
        result.wait_message = "creating pods"
    else:
        result.not_ready_reason = "PodsNotReady"
        waiting = sum(max(req - result.ready[(p, r)], 0) for p, r, _, req in wanted)
        result.wait_message = f"waiting for {waiting} pods to become ready"
    return result


def _annotate(out: Plan, pod: str, values: dict[str, str | None]) -> None:
    out.annotate.setdefault(pod, {}).update(values)


def _scale_in(
    out: Plan,
    observed: Observed,
    *,
    pods: list[Child],
    policy: str,
    role: Role,
    count: int,
    settings: OperatorSettings,
    now: datetime,
) -> None:
    """Pods of an elastic role with index >= count: drain the busy ones, delete the rest."""
    from polyrl_operator.plan import Event

    for pod in sorted(pods, key=lambda p: p.index):
        if pod.role != role or (pod.policy or "") != policy or pod.index < count or pod.deleting:
            continue
        if pod.terminated or not pod.ready:
            continue  # nothing runs on it: it is simply deleted
        since_text = pod.annotation(naming.ANNOTATION_DRAIN_SINCE)
        since = parse_time(since_text) or now
        if _worker_drained(observed, policy, pod.name):
            out.events.append(Event("Normal", "Drained", f"pod {pod.name} drained; deleting it"))
            continue
        if (now - since).total_seconds() >= settings.drain_timeout:
            out.events.append(
                Event(
                    "Warning",
                    "DrainTimeout",
                    f"pod {pod.name} not drained after {settings.drain_timeout:g}s; deleting it",
                )
            )
            continue
        out.keep.add(("Pod", pod.name))
        if pod.annotation(naming.ANNOTATION_DRAIN) != "true":
            _annotate(
                out, pod.name, {naming.ANNOTATION_DRAIN: "true", naming.ANNOTATION_DRAIN_SINCE: rfc3339(now)}
            )
            out.events.append(Event("Normal", "Draining", f"draining pod {pod.name} before deleting it"))
        remaining = settings.drain_timeout - (now - since).total_seconds()
        out.requeue(min(settings.progress_interval, remaining))


def _stop(
    out: Plan,
    observed: Observed,
    *,
    pods: list[Child],
    stop_reason: str,
    settings: OperatorSettings,
    now: datetime,
    result: PodPlan,
) -> None:
    """No pod should run: checkpoint first (suspend, eviction) when a coordinator is up, then delete."""
    from polyrl_operator.plan import Event

    coordinator = next(
        (p for p in pods if p.role == "coordinator" and not p.deleting and p.phase == "Running"), None
    )
    result.stop_message = "deleting pods"
    if stop_reason not in ("Suspended", "Evicted") or coordinator is None:
        return
    request = coordinator.annotation(naming.ANNOTATION_CHECKPOINT)
    since = parse_time(coordinator.annotation(naming.ANNOTATION_CHECKPOINT_SINCE))
    if request is None or since is None:
        # Not visible on the pod yet: reuse a request made a moment ago (the index may lag our patch).
        remembered = out.memory.checkpoint
        if remembered is not None and parse_time(remembered[1]) is not None:
            request, since_text = remembered
        else:
            request, since_text = f"{stop_reason.lower()}-{now.strftime('%Y%m%dT%H%M%SZ')}", rfc3339(now)
            out.events.append(
                Event(
                    "Normal",
                    "CheckpointRequested",
                    f"asked the coordinator to checkpoint ({request}) before deleting pods",
                )
            )
        since = parse_time(since_text) or now
        out.memory.checkpoint = (request, since_text)
        _annotate(
            out,
            coordinator.name,
            {naming.ANNOTATION_CHECKPOINT: request, naming.ANNOTATION_CHECKPOINT_SINCE: since_text},
        )
    progress = observed.progress
    done = (
        progress is not None
        and progress.checkpoint.last_request_id == request
        and not progress.checkpoint.in_progress
    )
    waited = (now - since).total_seconds()
    if done:
        out.events.append(
            Event(
                "Normal",
                "Checkpointed",
                f"checkpoint {request} done at step {progress.checkpoint.last_step if progress else '?'}; deleting pods",
            )
        )
        return
    if waited >= settings.checkpoint_timeout:
        out.events.append(
            Event(
                "Warning",
                "CheckpointTimeout",
                f"no checkpoint after {settings.checkpoint_timeout:g}s; deleting pods anyway",
            )
        )
        return
    for pod in pods:
        if not pod.deleting:
            out.keep.add(("Pod", pod.name))
    result.stop_message = f"checkpointing before deleting pods (request {request})"
    out.requeue(min(settings.progress_interval, settings.checkpoint_timeout - waited))


__all__ = ["PodPlan", "plan_pods", "pod_name"]
