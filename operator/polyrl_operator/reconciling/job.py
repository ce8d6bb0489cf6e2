"""One job's reconcile: observe -> plan -> write status -> apply.

Status is written before children are touched, guarded by resourceVersion: a decision that must not
be taken twice (a restart) is recorded atomically first, so a kill between the two steps cannot
double-count it. Status is written here only, from the plan: what apply reports (a child the API
server refused, a quota refusal) goes into the job's memory and is an input of the next plan, which
is asked for at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any

import structlog

from polyrl_operator import naming
from polyrl_operator.api import API_VERSION, KIND
from polyrl_operator.apply import ApplyResult, apply_plan, delete_pods, patch_for_status
from polyrl_operator.kube import ApiError, KubeClient, path_for
from polyrl_operator.metrics import Metrics
from polyrl_operator.observed import Child
from polyrl_operator.planning import JobMemory, Plan, QuotaRefusal, plan
from polyrl_operator.planning.quota import quota_back, refused
from polyrl_operator.reconciling.events import EventRecorder, apply_events
from polyrl_operator.reconciling.observe import Observer
from polyrl_operator.reconciling.queue import Key
from polyrl_operator.settings import OperatorSettings

log = structlog.get_logger("polyrl.reconcile")

Kick = Callable[[Key, float], None]


def _rljob_path(namespace: str, name: str, subresource: str | None = None) -> str:
    return path_for(API_VERSION, KIND, namespace, name, subresource)


class JobReconciler:
    def __init__(
        self,
        client: KubeClient,
        settings: OperatorSettings,
        metrics: Metrics,
        *,
        observer: Observer,
        recorder: EventRecorder,
        kick: Kick,
        clock: Callable[[], datetime],
    ) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.observer = observer
        self.recorder = recorder
        self.kick = kick
        self.clock = clock
        self.memory: dict[Key, JobMemory] = {}
        """What each job's plans remember between reconciles (lost on restart, harmlessly)."""

    def forget(self, key: Key) -> None:
        self.memory.pop(key, None)

    async def reconcile(self, key: Key) -> Plan | None:
        now = self.clock()
        observation = await self.observer.observe(key)
        if observation is None:
            return None
        if observation.look_again is not None:
            self.kick(key, observation.look_again)
        result = plan(observation.body, observation.observed, self.settings, now, self.memory.get(key))
        self.memory[key] = result.memory
        with structlog.contextvars.bound_contextvars(namespace=key[0], job=key[1]):
            body = await self._write_job(key, observation.body, result)
            if body is None:
                return result
            children = observation.observed.children
            applied = await apply_plan(
                self.client, result, children, concurrency=self.settings.max_concurrent_writes
            )
            await self._follow_apply(key, body, result, applied, children)
            if applied.writes or observation.deleting:
                log.info(
                    "reconciled",
                    phase=result.status.phase if result.status else None,
                    created=len(applied.created),
                    deleted=len(applied.deleted),
                    patched=len(applied.patched),
                )
        return result

    async def _write_job(self, key: Key, body: dict[str, Any], result: Plan) -> dict[str, Any] | None:
        """Finalizer and status first (both guarded by resourceVersion); None: stale view, retry."""
        if result.finalizer == "add":
            body = await self._set_finalizer(key, body, add=True)
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return body
        new = result.status.to_k8s() if result.status is not None else None
        patch = (
            None
            if new is None
            else patch_for_status(body.get("status") or {}, new, meta.get("resourceVersion"))
        )
        if patch is not None:
            try:
                body = await self.client.patch(_rljob_path(*key, "status"), patch)
            except ApiError as exc:
                if exc.status == 409:
                    # Our view of the job is stale: the watch brings the new version and kicks again.
                    self.kick(key, 0.5)
                    return None
                raise
            self.observer.store_newer(key, body)
            # Decisions count once: only when the status that records them was written.
            self.metrics.restarts.inc(sum(1 for e in result.events if e.reason == "Restarting"))
            for _, role, before, after in result.scaled:
                self.metrics.scale_decisions.labels(role, "out" if after > before else "in").inc()
        await self.recorder.record(key, body, result.events)
        return body

    async def _follow_apply(
        self, key: Key, body: dict[str, Any], result: Plan, applied: ApplyResult, children: list[Child]
    ) -> None:
        """What apply reported, as inputs of the next plan; the finalizer, the TTL's deletion and
        the plan's requeue."""
        namespace, name = key
        if applied.rejected is not None:
            # The spec renders an object the API server refuses: no retry can fix that. The next
            # plan reports InvalidSpec (naming what was refused) and removes what was created.
            log.warning("invalid spec: a child was refused", error=applied.rejected)
            generation = (body.get("metadata") or {}).get("generation")
            self.memory[key] = replace(self.memory[key], rejected=(generation, applied.rejected))
            self.kick(key, 0.0)
            return
        if applied.quota_error is not None:
            refusal = QuotaRefusal(applied.quota_error, applied.quota_required)
            await self._quota_refused(key, body, result, refusal, children)
        elif applied.created and result.running and result.memory.quota_message is not None:
            self.memory[key] = quota_back(self.memory[key])
            self.kick(key, 0.5)
        if not applied.quota_required:  # a rollback is reported as QuotaExceeded instead
            await self.recorder.record(key, body, apply_events(applied.created, applied.deleted))
        if result.finalizer == "remove":
            await self._set_finalizer(key, body, add=False)
        if result.delete_job:
            try:
                await self.client.delete(_rljob_path(namespace, name))
            except ApiError as exc:
                if exc.status != 404:
                    raise
        if result.requeue_after is not None:
            self.kick(key, result.requeue_after)

    async def _quota_refused(
        self, key: Key, body: dict[str, Any], result: Plan, refusal: QuotaRefusal, children: list[Child]
    ) -> None:
        """All or nothing: a job whose required pods do not all fit runs none of them. The
        refusal is remembered for the next plan, whose status reports it."""
        after = refused(
            self.memory[key], refusal, status=result.status, settings=self.settings, now=self.clock()
        )
        self.memory[key] = after.memory
        if refusal.required:
            # The rollback: every pod of the job, those just created included (not indexed yet).
            own = {c.name for c in children if c.kind == "Pod" and c.owner_uid == result.ref.uid}
            names = sorted(own | {name for kind, name in result.desired if kind == "Pod"})
            await delete_pods(self.client, key[0], names, concurrency=self.settings.max_concurrent_writes)
        await self.recorder.record(key, body, [after.event])
        self.kick(key, after.look_again)

    async def _set_finalizer(self, key: Key, body: dict[str, Any], *, add: bool) -> dict[str, Any]:
        meta = body.get("metadata") or {}
        current = list(meta.get("finalizers") or [])
        wanted = [*current, naming.FINALIZER] if add else [f for f in current if f != naming.FINALIZER]
        patch = {"metadata": {"finalizers": wanted or None, "resourceVersion": meta.get("resourceVersion")}}
        try:
            updated = await self.client.patch(_rljob_path(*key), patch)
        except ApiError as exc:
            if exc.status == 404 and not add:
                return body  # already gone
            raise
        if add:
            self.observer.store_newer(key, updated)
        return updated
