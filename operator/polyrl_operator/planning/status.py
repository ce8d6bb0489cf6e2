"""The RLJob status, computed once, typed: pure functions from the job, the observed children (as
the pod plan counts them), the coordinator's report and the apply outcome to ``RLJobStatus``.

Three shapes of job: invalid (nothing runs), finished (Succeeded or Failed) and live; one function
each. A quota refusal reported by apply is an input of the next plan (``StatusInputs.refusal``),
so no other code writes status. Events that mark a change of state (admitted, suspended, resumed,
invalid spec, a policy's trainer restarting alone or frozen) are derived by comparing the old and
the new status, never decided a second time.
"""

from __future__ import annotations

from datetime import datetime

from polyrl_operator.api import PolicyStatus, PoolStatus, RLJob, RLJobStatus, RoleCounts, Staleness
from polyrl_operator.api.progress import EvalProgress, PoolProgress, Progress
from polyrl_operator.api.status import ConditionType, EvalStatus, Phase, SharedBaseStatus
from polyrl_operator.planning.conditions import Setting, clip, get_condition, rfc3339, set_conditions
from polyrl_operator.planning.lifecycle import Verdict
from polyrl_operator.planning.pods import empty_pod_plan
from polyrl_operator.planning.types import Event, PodPlan, RoleKey, StatusInputs
from polyrl_operator.roles import role_slots

SUMMARY_LIMIT = 4096
"""The CRD's maxLength of status.policySummary."""


def policy_statuses(
    job: RLJob, old: RLJobStatus, progress: Progress | None, pods: PodPlan
) -> list[PolicyStatus]:
    """Each policy's progress (from the report, else as last written) and its pod counts. Its
    trainer's restarts and state are the report's as they are: the coordinator counts restarts
    since it started, so a restart of the job starts them again from 0."""
    previous = {p.name: p for p in old.policies or []}
    out = []
    for p in job.spec.policies:
        entry = previous.get(p.name) or PolicyStatus(name=p.name)
        prog = progress.policy(p.name) if progress is not None else None
        if prog is not None:
            entry = entry.model_copy(
                update={
                    "version": prog.version,
                    "step": prog.step,
                    "reward_mean": prog.reward_mean if prog.reward_mean is not None else entry.reward_mean,
                    "staleness": (
                        Staleness(mean=prog.staleness.mean, max=prog.staleness.max)
                        if prog.staleness is not None
                        else entry.staleness
                    ),
                    "last_checkpoint_step": (
                        prog.last_checkpoint_step
                        if prog.last_checkpoint_step is not None
                        else entry.last_checkpoint_step
                    ),
                    "evaluation": eval_status(prog.evaluation) or entry.evaluation,
                    "rating": prog.rating if prog.rating is not None else entry.rating,
                    "restarts": prog.restarts,
                    "trainer_state": prog.trainer_state,
                }
            )
        rollout, trainer = job.spec.rollout_placement(p), job.spec.trainer_placement(p)
        out.append(
            entry.model_copy(
                update={
                    "rollout": _counts(pods, (p.name, "rollout"), rollout.pool),
                    # A frozen policy (`trainer: null`) is frozen from the start, before any report.
                    "trainer": RoleCounts(desired=0, ready=0)
                    if p.frozen
                    else _counts(pods, (p.name, "trainer"), trainer.pool),
                    **({"trainer_state": "frozen"} if p.frozen else {}),
                }
            )
        )
    return out


def trained_steps(job: RLJob, policies: list[PolicyStatus]) -> list[int]:
    """The steps of the policies that train (a frozen one, `trainer: null`, stays at step 0): what
    the job's `step` is the smallest of."""
    served = {p.name for p in job.spec.policies if p.frozen}
    return [p.step for p in policies if p.name not in served]


def _counts(pods: PodPlan, key: RoleKey, pool: str | None) -> RoleCounts:
    """A role's pod counts; a pooled role's are the pods of its pool it runs on (pool named)."""
    return RoleCounts(desired=pods.desired[key], ready=pods.ready[key], pool=pool)


def pool_statuses(
    job: RLJob, old: RLJobStatus, progress: Progress | None, pods: PodPlan
) -> list[PoolStatus] | None:
    """Each pool's pod counts, the roles placed on it and its busy fraction and switches (from the
    report, else as last written; unset on a pool the coordinator does not schedule, one that hosts
    no trainer). None for a job without pools."""
    if not job.spec.pools:
        return None
    previous = {q.name: q for q in old.pools or []}
    out = []
    for slot in role_slots(job):
        if slot.pool is None:
            continue
        reported = progress.pool(slot.pool) if progress is not None else None
        usage: PoolProgress | PoolStatus | None = (
            reported if reported is not None else previous.get(slot.pool)
        )
        out.append(
            PoolStatus(
                name=slot.pool,
                desired=pods.desired[(slot.pool, slot.role)],
                ready=pods.ready[(slot.pool, slot.role)],
                roles=[str(r) for r in slot.placed],
                busy_fraction=usage.busy_fraction if usage is not None else None,
                switches=usage.switches if usage is not None else None,
                shared_bases=[
                    SharedBaseStatus(
                        model=b.model_uri,
                        dtype=b.dtype,
                        policies=list(b.policies),
                        frozen=list(b.frozen) or None,
                    )
                    for b in job.spec.shared_bases()
                    if b.pool == slot.pool
                ]
                or None,
            )
        )
    return out


def rating_summary(policies: list[PolicyStatus]) -> str | None:
    """``player:1147``: what the ``Ratings`` printer column shows (league policies with a rating)."""
    rated = [f"{p.name}:{p.rating:.0f}" for p in policies if p.rating is not None]
    return clip(" ".join(rated), SUMMARY_LIMIT) if rated else None


def pool_summary(pools: list[PoolStatus] | None) -> str | None:
    """``shared:2/3``: what the ``Pools`` printer column shows (ready/desired pods per pool)."""
    if pools is None:
        return None
    return clip(" ".join(f"{q.name}:{q.ready}/{q.desired}" for q in pools), SUMMARY_LIMIT)


def eval_status(ev: EvalProgress | None) -> EvalStatus | None:
    """The status form of a policy's latest evaluation pass in the report."""
    if ev is None:
        return None
    return EvalStatus(step=ev.step, reward_mean=ev.reward_mean, pass_at_k=ev.pass_at_k, k=ev.k)


def policy_summary(policies: list[PolicyStatus]) -> str:
    """``speaker:v41 listener:v40``: what the ``Policies`` printer column shows."""
    return clip(" ".join(f"{p.name}:v{p.version}" for p in policies), SUMMARY_LIMIT)


def frozen_condition(job: RLJob, policies: list[PolicyStatus]) -> Setting:
    """The PolicyFrozen condition: True while a policy's trainer is frozen (out of restarts under
    onPolicyFailure freeze), naming them; the other policies train on. A policy the spec freezes
    (`trainer: null`) is not a failure: it is not named."""
    served = {p.name for p in job.spec.policies if p.frozen}
    frozen = [p.name for p in policies if p.trainer_state == "frozen" and p.name not in served]
    if not frozen:
        return False, "NotFrozen", ""
    which = f"policy {frozen[0]} is" if len(frozen) == 1 else f"policies {', '.join(frozen)} are"
    return (
        True,
        "Frozen",
        f"{which} frozen: out of restarts under onPolicyFailure freeze, serving the last version "
        "untrained while the other policies train on",
    )


def policy_events(job: RLJob, old: RLJobStatus, new: RLJobStatus) -> tuple[Event, ...]:
    """Events for what befell each policy's trainer between two statuses: a restart of it alone
    (its count rose) and its freezing. Each change is recorded once: the next plan compares
    with the status that already holds it."""
    before = {p.name: p for p in old.policies or []}
    names = {p.name for p in job.spec.policies if not p.frozen}  # a frozen one's trainer never runs
    events: list[Event] = []
    for entry in new.policies or []:
        if entry.name not in names:
            continue
        was = before.get(entry.name) or PolicyStatus(name=entry.name)
        limit, _ = job.spec.policy_failure(entry.name)
        if entry.restarts > was.restarts:
            events.append(
                Event(
                    "Warning",
                    "PolicyRestarting",
                    f"policy {entry.name}: its trainer failed and restarts alone from its latest "
                    f"checkpoint (restart {entry.restarts} of {limit}); the other policies train on",
                )
            )
        if entry.trainer_state == "frozen" and was.trainer_state != "frozen":
            events.append(
                Event(
                    "Warning",
                    "PolicyFrozen",
                    f"policy {entry.name}: its trainer failed past maxRestarts ({limit}) under "
                    f"onPolicyFailure freeze; frozen at step {entry.step}, its engines serve version "
                    f"{entry.version} and the other policies train on",
                )
            )
    return tuple(events)


def _with_policies(
    status: RLJobStatus, policies: list[PolicyStatus], step: int, pools: list[PoolStatus] | None
) -> RLJobStatus:
    return status.model_copy(
        update={
            "policies": policies,
            "policy_summary": policy_summary(policies),
            "rating_summary": rating_summary(policies),
            "step": step,
            "pools": pools,
            "pool_summary": pool_summary(pools),
        }
    )


def invalid_status(old: RLJobStatus, message: str, generation: int | None, now: datetime) -> RLJobStatus:
    """The spec cannot run: Failed with reason InvalidSpec and the message naming the field."""
    message = clip(message)
    reason = "InvalidSpec"
    conditions = set_conditions(
        old.conditions,
        {
            "Admitted": (False, reason, message),
            "Ready": (False, reason, message),
            "Progressing": (False, reason, message),
            "Suspended": (False, reason, ""),
            "Succeeded": (False, reason, ""),
            "Failed": (True, reason, message),
            "QuotaExceeded": (False, reason, ""),
            "PolicyFrozen": (False, reason, ""),
        },
        generation=generation,
        now=now,
    )
    return old.model_copy(
        update={
            "phase": "Failed",
            "observed_generation": generation,
            "message": clip(f"invalid spec: {message}"),
            "conditions": conditions,
            "step": old.step or 0,
            "policy_summary": old.policy_summary or "",
        }
    )


def finished_status(
    job: RLJob,
    old: RLJobStatus,
    *,
    verdict: Verdict | None,
    progress: Progress | None,
    generation: int | None,
    now: datetime,
) -> RLJobStatus:
    """Succeeded or Failed: ``verdict`` when it finished just now, else as ``old`` recorded it.

    The step of a Succeeded job is its final step (the largest over its policies, from the final
    report), not the last value read while it ran."""
    status = old.model_copy(update={"observed_generation": generation})
    values: dict[ConditionType, Setting] = {}
    if verdict is not None and verdict.kind != "restart":
        won = verdict.kind == "Succeeded"
        status = status.model_copy(
            update={"phase": verdict.kind, "completion_time": rfc3339(now), "message": clip(verdict.message)}
        )
        values["Succeeded"] = (won, verdict.reason if won else "NotSucceeded", verdict.message if won else "")
        values["Failed"] = (not won, "NotFailed" if won else verdict.reason, "" if won else verdict.message)
    succeeded = status.phase == "Succeeded"
    message = status.message or ""
    no_pods = empty_pod_plan(job)
    policies = policy_statuses(job, status, progress, no_pods)
    values |= {
        "Admitted": (False, "Finished", ""),
        "Ready": (False, "Finished", message),
        "Progressing": (False, "Succeeded" if succeeded else "Failed", message),
        "Suspended": (False, "Finished", ""),
        "QuotaExceeded": (False, "Finished", ""),
        # Kept as the job ended: a policy frozen then stays so in the record.
        "PolicyFrozen": frozen_condition(job, policies),
    }
    conditions = set_conditions(status.conditions, values, generation=generation, now=now)
    steps = trained_steps(job, policies)
    step = (max(steps) if succeeded else min(steps)) if steps else 0
    status = status.model_copy(update={"conditions": conditions, "workflow": RoleCounts()})
    return _with_policies(status, policies, step, pool_statuses(job, status, progress, no_pods))


def active_status(inputs: StatusInputs) -> RLJobStatus:
    """The status of a job that is neither finished nor invalid.

    ``inputs.refusal``: apply's report that the API server refused a pod for quota; when the pod
    was one the job cannot run without, the job's pods were removed and it waits (phase Pending)."""
    old, now, job = inputs.old, inputs.now, inputs.job
    stop = inputs.stop_reason
    pods = inputs.pods
    quota = inputs.quota_message
    refusal = inputs.refusal
    if refusal is not None:
        quota = refusal.message
        if refusal.required:
            stop, pods = "QuotaExceeded", empty_pod_plan(job)
    policies = policy_statuses(job, old, inputs.progress, pods)
    steps = trained_steps(job, policies)
    step = min(steps) if steps else 0
    quota_now = (
        stop == "QuotaExceeded" or refusal is not None or (quota is not None and not pods.all_required_exist)
    )
    ready = stop is None and pods.ready_enough
    step_msg = f"step {step}/{job.spec.training.total_steps}"
    adm = inputs.admission
    phase: Phase
    if stop in ("Suspended", "Evicted"):
        phase = "Suspended"
        suspended = not pods.any_live
        reason = stop if suspended else "Suspending"
        if not suspended:
            msg = pods.stop_message
        elif stop == "Suspended":
            msg = "suspended: pods deleted, status kept"
        else:
            msg = f"evicted by Kueue: {adm.message}"
        sus: Setting = (suspended, reason, msg)
        prog: Setting = (False, stop, msg)
    else:
        was = get_condition(old, "Suspended")
        sus = (False, "Resumed" if was is not None and was.status == "True" else "NotSuspended", "")
        if stop == "DeadlineExceeded":
            phase, msg = "Running", f"deadline exceeded: {pods.stop_message}"
            prog = (False, stop, msg)
        elif stop is not None:
            phase = "Pending"
            msg = f"waiting for quota: {quota}" if stop == "QuotaExceeded" else adm.message
            prog = (False, stop, msg)
        elif ready:
            phase, msg = "Running", f"training: {step_msg}"
            prog = (True, "Training", step_msg)
        else:
            phase = "Admitted" if pods.all_required_exist else "Pending"
            msg = pods.wait_message or "starting pods"
            prog = (True, "Starting", msg)
    admitted: Setting = (adm.admitted, adm.reason, adm.message)
    if adm.admitted and quota_now:
        admitted = (False, "QuotaExceeded", quota or "")
    conditions = set_conditions(
        old.conditions,
        {
            "Admitted": admitted,
            "Ready": (
                ready,
                "PodsReady" if ready else (stop or pods.not_ready_reason),
                "all roles have their pods ready" if ready else msg,
            ),
            "Progressing": prog,
            "Suspended": sus,
            "Succeeded": (False, "NotSucceeded", ""),
            "Failed": (False, "NotFailed", ""),
            "QuotaExceeded": (
                quota_now,
                "QuotaExceeded" if quota_now else "WithinQuota",
                (quota or "") if quota_now else "",
            ),
            "PolicyFrozen": frozen_condition(job, policies),
        },
        generation=inputs.generation,
        now=now,
    )
    start = old.start_time
    if start is None and stop is None:
        start = rfc3339(now)
    status = old.model_copy(
        update={
            "phase": phase,
            "observed_generation": inputs.generation,
            "restarts": inputs.restarts,
            "conditions": conditions,
            "workflow": RoleCounts(
                desired=pods.desired[("", "workflow")], ready=pods.ready[("", "workflow")]
            ),
            "start_time": start,
            "completion_time": None,
            "message": clip(msg),
        }
    )
    return _with_policies(status, policies, step, pool_statuses(job, old, inputs.progress, pods))


def transition_events(old: RLJobStatus, new: RLJobStatus) -> tuple[Event, ...]:
    """Events for changes of state seen between two statuses (each recorded once per change)."""
    events: list[Event] = []
    failed, was_failed = get_condition(new, "Failed"), get_condition(old, "Failed")
    if failed is not None and failed.status == "True" and failed.reason == "InvalidSpec":
        if not (
            was_failed is not None
            and was_failed.reason == "InvalidSpec"
            and was_failed.message == failed.message
        ):
            events.append(Event("Warning", "InvalidSpec", failed.message))
        return tuple(events)
    adm, was_adm = get_condition(new, "Admitted"), get_condition(old, "Admitted")
    newly = was_adm is None or was_adm.status != "True"
    if adm is not None and adm.status == "True" and adm.reason == "Admitted" and newly:
        events.append(Event("Normal", "Admitted", adm.message))
    same = (
        was_adm is not None
        and adm is not None
        and (was_adm.reason, was_adm.message) == (adm.reason, adm.message)
    )
    if adm is not None and adm.reason == "PriorityNotFound" and not same:
        events.append(Event("Warning", "PriorityNotFound", adm.message))
    sus, was_sus = get_condition(new, "Suspended"), get_condition(old, "Suspended")
    if sus is not None and sus.reason in ("Suspended", "Evicted", "Suspending"):
        if was_sus is None or was_sus.reason != sus.reason:
            progressing = get_condition(new, "Progressing")
            evicted = progressing is not None and progressing.reason == "Evicted"
            events.append(Event("Warning" if evicted else "Normal", sus.reason, sus.message))
    elif was_sus is not None and was_sus.status == "True" and sus is not None and sus.status == "False":
        events.append(
            Event("Normal", "Resumed", "recreating pods; the runtime resumes from the last checkpoint")
        )
    return tuple(events)
