"""plan(job, observed) -> Plan: the pure heart of the operator.

Given the RLJob as stored, a snapshot of its children (from the kopf indexes), the coordinator's
/progress and the clock, it returns the exact set of children that should exist, the status to
write and the decisions taken (events). No I/O: the reconciler gathers the inputs and apply executes
the result, so every decision (restart, scale, drain, suspend, admission, TTL) is unit-testable.

Level-based: the plan depends only on what is observed now (plus the status the operator wrote
before, which records its own decisions: desired replica counts and restarts). Running it twice on
the same inputs gives the same result, which is why an unchanged job costs no write.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from polyrl_operator import naming
from polyrl_operator.api import RLJob
from polyrl_operator.autoscale import ScaleState
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
from polyrl_operator.builders.workload import admitted_placement
from polyrl_operator.checks import format_problems, operator_checks, parse_job
from polyrl_operator.observed import Child, Observed
from polyrl_operator.plan_pods import PodPlan, plan_pods
from polyrl_operator.settings import OperatorSettings
from polyrl_operator.status import clip, get_condition, parse_time, rfc3339, set_condition

Key = tuple[str, str]


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class JobMemory:
    """What the reconciler remembers between plans of one job (lost on restart, harmlessly)."""

    scale: dict[str, ScaleState] = field(default_factory=dict)
    quota_failures: int = 0
    quota_retry_at: float | None = None
    quota_message: str | None = None
    checkpoint: tuple[str, str] | None = None
    """(request id, since) of the checkpoint asked for, until the coordinator pod shows it."""
    rejected: tuple[int | None, str] | None = None
    """(generation, why) when the API server refused a child rendered from that generation's spec
    (422: e.g. a podTemplate field of the wrong type): InvalidSpec until the spec changes. Lost on
    restart, which costs one more refused attempt."""


@dataclass
class Plan:
    ref: JobRef
    status: dict[str, Any]
    desired: dict[Key, Manifest] = field(default_factory=dict)
    """Children that must exist with exactly this content (pods: recreated when the hash differs)."""
    keep: set[Key] = field(default_factory=set)
    """Children left as they are (e.g. finished pods kept for their logs); everything else goes."""
    annotate: dict[str, dict[str, str | None]] = field(default_factory=dict)
    """Pod annotations to set (None: remove) in place: drain marks and checkpoint requests."""
    required_pods: set[str] = field(default_factory=set)
    """Pods without which the job cannot run: a quota refusal of one of them rolls the job back."""
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    finalizer: Literal["add", "remove"] | None = None
    delete_job: bool = False
    memory: JobMemory = field(default_factory=JobMemory)
    scaled: list[tuple[str, str, int, int]] = field(default_factory=list)
    """(policy or "", role, from, to) for every scale decision."""
    running: bool = False
    """Pods are wanted (admitted, not suspended, not finished)."""

    def requeue(self, seconds: float) -> None:
        seconds = max(seconds, 0.5)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


def _key(manifest: Manifest) -> Key:
    return (str(manifest["kind"]), str(manifest["metadata"]["name"]))


def _add(out: Plan, manifest: Manifest) -> None:
    out.desired[_key(manifest)] = manifest


def _infrastructure(out: Plan, job: RLJob, ref: JobRef, settings: OperatorSettings) -> None:
    """ConfigMap, Secret, ServiceAccount, NetworkPolicies and Services: they exist for the job's
    whole life (pods come and go)."""
    _add(out, build_config_map(job, ref))
    _add(out, build_secret(ref, None))
    _add(out, build_service_account(ref))
    for policy in build_network_policies(ref, settings):
        _add(out, policy)
    _add(out, build_coordinator_service(ref))
    _add(out, build_headless_service(ref, "workflow"))
    for p in job.spec.policies:
        _add(out, build_headless_service(ref, "rollout", p.name))
        _add(out, build_headless_service(ref, "trainer", p.name))


def _conditions(
    status: dict[str, Any], gen: int | None, now: datetime, **values: tuple[bool, str, str]
) -> None:
    conds: list[dict[str, Any]] = status.get("conditions") or []
    for ctype, (value, reason, message) in values.items():
        conds = set_condition(conds, ctype, value, reason=reason, message=message, generation=gen, now=now)
    status["conditions"] = conds


def _policy_status(
    job: RLJob, old: dict[str, Any], observed: Observed, pods: PodPlan
) -> list[dict[str, Any]]:
    previous = {p.get("name"): p for p in old.get("policies") or []}
    out = []
    for p in job.spec.policies:
        entry: dict[str, Any] = {
            k: v for k, v in (previous.get(p.name) or {}).items() if k not in ("rollout", "trainer")
        }
        entry["name"] = p.name
        prog = observed.progress.policy(p.name) if observed.progress else None
        if prog is not None:
            entry["version"] = prog.version
            entry["step"] = prog.step
            if prog.reward_mean is not None:
                entry["rewardMean"] = prog.reward_mean
            if prog.staleness is not None:
                entry["staleness"] = {"mean": prog.staleness.mean, "max": prog.staleness.max}
            if prog.last_checkpoint_step is not None:
                entry["lastCheckpointStep"] = prog.last_checkpoint_step
        entry.setdefault("version", 0)
        entry.setdefault("step", 0)
        entry["rollout"] = {
            "desired": pods.desired[(p.name, "rollout")],
            "ready": pods.ready[(p.name, "rollout")],
        }
        entry["trainer"] = {
            "desired": pods.desired[(p.name, "trainer")],
            "ready": pods.ready[(p.name, "trainer")],
        }
        out.append(entry)
    return out


def _workload_admitted(wl: Child | None) -> tuple[bool, str, str]:
    """(admitted, reason, message) from a Workload's status as Kueue writes it."""
    if wl is None:
        return False, "WorkloadCreating", "creating the Kueue Workload"
    st = wl.workload_status or {}
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    evicted = conds.get("Evicted") or {}
    if evicted.get("status") == "True":
        return False, "Evicted", str(evicted.get("message") or evicted.get("reason") or "evicted by Kueue")
    admitted = (conds.get("Admitted") or {}).get("status") == "True"
    if admitted and st.get("admission"):
        cq = (st.get("admission") or {}).get("clusterQueue", "")
        return True, "Admitted", f"admitted by ClusterQueue {cq}"
    pending = conds.get("QuotaReserved") or {}
    return False, "Pending", str(pending.get("message") or "waiting for Kueue to admit the Workload")


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
    old: dict[str, Any] = copy.deepcopy(body.get("status") or {})
    out = Plan(ref=ref, status=copy.deepcopy(old), memory=copy.deepcopy(memory or JobMemory()))
    finalizers = meta.get("finalizers") or []

    if meta.get("deletionTimestamp"):
        # Explicit cleanup (no garbage collector is assumed): every child goes, then the finalizer.
        if naming.FINALIZER in finalizers:
            if observed.children:
                out.requeue(1.0)
            else:
                out.finalizer = "remove"
        return out
    if naming.FINALIZER not in finalizers:
        out.finalizer = "add"

    own = [c for c in observed.children if c.owner_uid == ref.uid]
    status = out.status
    status["observedGeneration"] = gen
    status.setdefault("restarts", 0)
    status.setdefault("phase", "Pending")

    job, problems = parse_job(body)
    if job is not None:
        problems += operator_checks(job, settings)
    if job is None or problems:
        message = format_problems(problems)
        _invalid(out, old, message, gen, now)
        return out
    if out.memory.rejected is not None:
        if out.memory.rejected[0] == gen:
            _invalid(out, old, out.memory.rejected[1], gen, now)
            return out
        out.memory.rejected = None  # a new spec: try it

    failed_cond = get_condition(old, "Failed") or {}
    terminal = old.get("phase") == "Succeeded" or (
        old.get("phase") == "Failed" and failed_cond.get("reason") != "InvalidSpec"
    )
    restarts = int(old.get("restarts") or 0)
    if observed.progress is not None and observed.progress.attempt not in (None, restarts):
        # The coordinator of an earlier attempt, still answering while its pod goes. Its "failed" was
        # already counted: read as the new attempt's, it restarted the job a second time (CI).
        observed = replace(observed, progress=None)
    progress = observed.progress
    pods = [c for c in own if c.kind == "Pod"]
    coordinator = next((c for c in pods if c.role == "coordinator" and not c.deleting), None)

    if not terminal:
        verdict = _terminal_verdict(job, progress, coordinator, pods, restarts)
        if verdict is not None:
            kind, reason, message = verdict
            if kind == "restart":
                status["restarts"] = restarts = restarts + 1
                out.events.append(Event("Warning", "Restarting", message))
            else:
                terminal = True
                status["phase"] = kind
                status["completionTime"] = rfc3339(now)
                status["message"] = clip(message)
                out.events.append(Event("Normal" if kind == "Succeeded" else "Warning", reason, message))
                _conditions(
                    status,
                    gen,
                    now,
                    Succeeded=(
                        kind == "Succeeded",
                        reason if kind == "Succeeded" else "NotSucceeded",
                        message if kind == "Succeeded" else "",
                    ),
                    Failed=(
                        kind == "Failed",
                        reason if kind == "Failed" else "NotFailed",
                        message if kind == "Failed" else "",
                    ),
                )

    _infrastructure(out, job, ref, settings)
    queue = job.spec.scheduling.queue_name if job.spec.scheduling else None
    workload = next((c for c in own if c.kind == "Workload"), None)

    if terminal:
        _finished(out, job, pods=pods, observed=observed, gen=gen, now=now)
        return out

    admitted, adm_reason, adm_message = (
        True,
        "NoQueue",
        "no scheduling.queueName: pods are created directly",
    )
    admission = None
    if queue:
        _add(out, build_workload(job, ref, settings, active=not job.spec.suspend))
        admitted, adm_reason, adm_message = _workload_admitted(workload)
        if admitted and workload is not None:
            admission = admitted_placement({"status": workload.workload_status}, observed.flavors)
    evicted = adm_reason == "Evicted"
    quota_blocked = (
        not queue and out.memory.quota_retry_at is not None and now.timestamp() < out.memory.quota_retry_at
    )
    if quota_blocked and out.memory.quota_retry_at is not None:
        out.requeue(out.memory.quota_retry_at - now.timestamp())
    stop_reason: str | None = None
    if job.spec.suspend:
        stop_reason = "Suspended"
    elif evicted:
        stop_reason = "Evicted"
    elif not admitted:
        stop_reason = "NotAdmitted"
    elif quota_blocked:
        stop_reason = "QuotaExceeded"
    out.running = stop_reason is None

    pod_plan = plan_pods(
        out,
        job,
        ref=ref,
        settings=settings,
        observed=observed,
        pods=pods,
        restarts=restarts,
        stop_reason=stop_reason,
        admission=admission,
        old=old,
        now=now,
    )
    _active_status(
        out,
        job,
        old=old,
        observed=observed,
        pods=pod_plan,
        stop_reason=stop_reason,
        admission=(admitted, adm_reason, adm_message),
        gen=gen,
        now=now,
    )
    return out


def _terminal_verdict(
    job: RLJob,
    progress: Any,
    coordinator: Child | None,
    pods: list[Child],
    restarts: int,
) -> tuple[str, str, str] | None:
    """("Succeeded"|"Failed"|"restart", reason, message) when the job finished or must restart."""
    if (progress is not None and progress.state == "done") or (
        coordinator is not None and coordinator.phase == "Succeeded"
    ):
        detail = progress.message if progress is not None and progress.message else "training finished"
        return "Succeeded", "Succeeded", detail
    if progress is not None and progress.state == "failed" and not progress.retryable:
        return "Failed", "RuntimeFailed", progress.message or "the coordinator reported a fatal error"
    failed = sorted(
        (
            p
            for p in pods
            if p.role in ("coordinator", "trainer")
            and p.phase == "Failed"
            and p.attempt == restarts
            and not p.deleting
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
        return "Failed", "RestartLimitExceeded", f"{why}; restart limit {limit} reached"
    return (
        "restart",
        "Restarting",
        f"{why}; restarting the training roles from the last checkpoint ({restarts + 1}/{limit})",
    )


def _invalid(out: Plan, old: dict[str, Any], message: str, gen: int | None, now: datetime) -> None:
    message = clip(message)  # as the conditions keep it, so an unchanged spec repeats no event
    status = out.status
    status["phase"] = "Failed"
    status["message"] = clip(f"invalid spec: {message}")
    _conditions(
        status,
        gen,
        now,
        Admitted=(False, "InvalidSpec", message),
        Ready=(False, "InvalidSpec", message),
        Progressing=(False, "InvalidSpec", message),
        Suspended=(False, "InvalidSpec", ""),
        Succeeded=(False, "InvalidSpec", ""),
        Failed=(True, "InvalidSpec", message),
        QuotaExceeded=(False, "InvalidSpec", ""),
    )
    prior = get_condition(old, "Failed") or {}
    if not (prior.get("reason") == "InvalidSpec" and prior.get("message") == message):
        out.events.append(Event("Warning", "InvalidSpec", message))


def _finished(
    out: Plan,
    job: RLJob,
    *,
    pods: list[Child],
    observed: Observed,
    gen: int | None,
    now: datetime,
) -> None:
    """Succeeded or Failed: free the hardware at once (running pods go, the Workload goes so Kueue
    releases the quota), keep finished pods for their logs, and delete the job after its TTL."""
    status = out.status
    succeeded = status.get("phase") == "Succeeded"
    for pod in pods:
        if pod.terminated or (succeeded and pod.role == "coordinator"):
            out.keep.add(("Pod", pod.name))
    message = status.get("message") or ""
    _conditions(
        status,
        gen,
        now,
        Admitted=(False, "Finished", ""),
        Ready=(False, "Finished", message),
        Progressing=(False, "Succeeded" if succeeded else "Failed", message),
        Suspended=(False, "Finished", ""),
        QuotaExceeded=(False, "Finished", ""),
    )
    counts = PodPlan.empty(job)
    status["policies"] = _policy_status(job, status, observed, counts)
    status["workflow"] = {"desired": 0, "ready": 0}
    ttl = job.spec.ttl_seconds_after_finished
    done_at = parse_time(status.get("completionTime"))
    if ttl is not None and done_at is not None:
        expires = done_at + timedelta(seconds=ttl)
        if now >= expires:
            out.delete_job = True
            out.events.append(Event("Normal", "Expired", f"deleting the job {ttl}s after it finished"))
        else:
            out.requeue((expires - now).total_seconds())


def _active_status(
    out: Plan,
    job: RLJob,
    *,
    old: dict[str, Any],
    observed: Observed,
    pods: PodPlan,
    stop_reason: str | None,
    admission: tuple[bool, str, str],
    gen: int | None,
    now: datetime,
) -> None:
    status = out.status
    admitted, adm_reason, adm_message = admission
    status["policies"] = _policy_status(job, old, observed, pods)
    status["workflow"] = {"desired": pods.desired[("", "workflow")], "ready": pods.ready[("", "workflow")]}
    steps = [p.get("step", 0) for p in status["policies"]]
    status["step"] = min(steps) if steps else 0
    status.pop("completionTime", None)
    quota = out.memory.quota_message
    quota_now = stop_reason == "QuotaExceeded" or (quota is not None and not pods.all_required_exist)
    ready = stop_reason is None and pods.ready_enough
    total = job.spec.training.total_steps
    step_msg = f"step {status['step']}/{total}"
    if stop_reason in ("Suspended", "Evicted"):
        phase = "Suspended"
        suspended = not pods.any_live
        reason = stop_reason if suspended else "Suspending"
        msg = (
            (
                "suspended: pods deleted, status kept"
                if stop_reason == "Suspended"
                else f"evicted by Kueue: {adm_message}"
            )
            if suspended
            else pods.stop_message
        )
        sus = (suspended, reason, msg)
        prog = (False, stop_reason, msg)
        if (get_condition(old, "Suspended") or {}).get("reason") != reason:
            out.events.append(Event("Normal" if stop_reason == "Suspended" else "Warning", reason, msg))
    else:
        was = get_condition(old, "Suspended") or {}
        sus = (False, "Resumed" if was.get("status") == "True" else "NotSuspended", "")
        if was.get("status") == "True":
            out.events.append(
                Event("Normal", "Resumed", "recreating pods; the runtime resumes from the last checkpoint")
            )
        if stop_reason is not None:
            phase, msg = (
                "Pending",
                (f"waiting for quota: {quota}" if stop_reason == "QuotaExceeded" else adm_message),
            )
            prog = (False, stop_reason, msg)
        elif ready:
            phase, msg = "Running", f"training: {step_msg}"
            prog = (True, "Training", step_msg)
        else:
            phase = "Admitted" if pods.all_required_exist else "Pending"
            msg = pods.wait_message or "starting pods"
            prog = (True, "Starting", msg)
    if stop_reason is None and "startTime" not in status:
        status["startTime"] = rfc3339(now)
    status["phase"] = phase
    status["message"] = clip(msg)
    prior = get_condition(old, "Admitted") or {}
    if admitted and adm_reason == "Admitted" and prior.get("status") != "True":
        out.events.append(Event("Normal", "Admitted", adm_message))
    if admitted and quota_now:
        adm = (False, "QuotaExceeded", quota or "")
    else:
        adm = (admitted, adm_reason, adm_message)
    _conditions(
        status,
        gen,
        now,
        Admitted=adm,
        Ready=(
            ready,
            "PodsReady" if ready else (stop_reason or pods.not_ready_reason),
            "all roles have their pods ready" if ready else msg,
        ),
        Progressing=prog,
        Suspended=sus,
        Succeeded=(False, "NotSucceeded", ""),
        Failed=(False, "NotFailed", ""),
        QuotaExceeded=(
            quota_now,
            "QuotaExceeded" if quota_now else "WithinQuota",
            quota or "" if quota_now else "",
        ),
    )
