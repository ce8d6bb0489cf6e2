"""The reconcile loop: observe -> plan -> status -> apply, one job at a time, coalescing triggers.

kopf delivers RLJob events, child events (through the indexes) and timer ticks; all of them just
``kick`` a job. A job has at most one reconcile running; kicks that arrive meanwhile make it run once
more afterwards (no lost trigger, no pile-up). Status is written before children are touched, guarded
by resourceVersion: a decision that must not be taken twice (a restart) is recorded atomically first,
so a kill between the two steps cannot double-count it.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import aiohttp
import structlog
from pydantic import ValidationError

from polyrl_operator import naming
from polyrl_operator.api import API_VERSION, KIND
from polyrl_operator.api.progress import Progress
from polyrl_operator.apply import apply_plan, delete_pods, patch_for_status
from polyrl_operator.builders.workload import admission_flavors
from polyrl_operator.kinds import KUEUE_API_VERSION
from polyrl_operator.kube import ApiError, KubeClient, path_for
from polyrl_operator.metrics import Metrics
from polyrl_operator.observed import Child, Observed, summarize
from polyrl_operator.planning import Event, JobMemory, Plan, QuotaRefusal, active_status, plan
from polyrl_operator.planning.conditions import rfc3339
from polyrl_operator.priority import observe_priority
from polyrl_operator.settings import OperatorSettings

log = structlog.get_logger("polyrl.reconcile")

Key = tuple[str, str]
Index = Mapping[Key, Iterable[Child]]
EVENT_DEDUP_SECONDS = 300.0


def _rljob_path(namespace: str, name: str, subresource: str | None = None) -> str:
    return path_for(API_VERSION, KIND, namespace, name, subresource)


class Reconciler:
    def __init__(
        self,
        client: KubeClient,
        settings: OperatorSettings,
        metrics: Metrics | None = None,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.jobs: dict[Key, dict[str, Any]] = {}
        self.indexes: dict[str, Index] = {}
        """Child summaries by kind, keyed (namespace, job): kopf's live index views."""
        self.memory: dict[Key, JobMemory] = {}
        self._progress: dict[Key, tuple[float, Progress | None, str | None]] = {}
        self._flavors: dict[str, tuple[float, dict[str, Any]]] = {}
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._dirty: set[Key] = set()
        self._timers: dict[Key, tuple[float, asyncio.TimerHandle]] = {}
        self._errors: dict[Key, int] = {}
        self._seen_events: dict[Key, dict[tuple[str, str], float]] = {}
        self._sem = asyncio.Semaphore(settings.max_concurrent_reconciles)
        self._http: aiohttp.ClientSession | None = None
        self._instance = socket.gethostname()
        self.reconciles = 0

    # ---- triggers -------------------------------------------------------------------------

    def update_job(self, body: dict[str, Any]) -> Key:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        self.jobs[key] = body
        return key

    def forget_job(self, key: Key) -> None:
        for store in (self.jobs, self.memory, self._progress, self._errors, self._seen_events):
            store.pop(key, None)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()

    def kick(self, key: Key, delay: float = 0.0) -> None:
        """Reconcile ``key`` now (or after ``delay``); repeated kicks coalesce."""
        loop = asyncio.get_running_loop()
        if delay > 0:
            due = loop.time() + delay
            current = self._timers.get(key)
            if current is not None and current[0] <= due:
                return
            if current is not None:
                current[1].cancel()
            self._timers[key] = (due, loop.call_at(due, self._fire, key))
            return
        if key in self._running:
            self._dirty.add(key)
            return
        self._running[key] = asyncio.create_task(self._worker(key), name=f"reconcile {key[0]}/{key[1]}")

    def _fire(self, key: Key) -> None:
        self._timers.pop(key, None)
        self.kick(key)

    async def _worker(self, key: Key) -> None:
        try:
            while True:
                self._dirty.discard(key)
                await self._reconcile_safely(key)
                if key not in self._dirty:
                    break
        finally:
            self._running.pop(key, None)

    async def idle(self) -> None:
        """Wait until no reconcile is running (tests and the benchmark use it)."""
        while self._running:
            await asyncio.gather(*list(self._running.values()), return_exceptions=True)

    async def close(self) -> None:
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*list(self._running.values()), return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    async def resync_forever(self) -> None:
        """The periodic timer: every job is reconciled at least every resync_seconds."""
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            for key in list(self.jobs):
                self.kick(key)
            self.metrics.set_jobs((b.get("status") or {}).get("phase", "Pending") for b in self.jobs.values())
            pods = self.indexes.get("Pod") or {}
            self.metrics.set_pods(c.role or "" for children in pods.values() for c in children)

    # ---- one reconcile --------------------------------------------------------------------

    async def _reconcile_safely(self, key: Key) -> None:
        async with self._sem:
            started = time.perf_counter()
            before = dict(self.client.requests)
            try:
                await self.reconcile(key)
                self._errors.pop(key, None)
                self.metrics.reconciles.labels("ok").inc()
            except ApiError as exc:
                result = "conflict" if exc.status == 409 else "error"
                self.metrics.reconciles.labels(result).inc()
                self.metrics.errors.labels(f"http{exc.status}").inc()
                self._backoff(key, exc)
            except Exception as exc:
                self.metrics.reconciles.labels("error").inc()
                self.metrics.errors.labels(type(exc).__name__).inc()
                self._backoff(key, exc)
            finally:
                self.reconciles += 1
                self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
                for verb, n in self.client.requests.items():
                    if n - before.get(verb, 0):
                        self.metrics.api_requests.labels(verb).inc(n - before.get(verb, 0))

    def _backoff(self, key: Key, exc: Exception) -> None:
        n = self._errors[key] = self._errors.get(key, 0) + 1
        delay = min(self.settings.error_backoff * 2 ** (n - 1), self.settings.error_backoff_max)
        conflict = isinstance(exc, ApiError) and exc.status == 409
        logger = log.info if conflict else log.warning
        logger("reconcile failed; retrying", namespace=key[0], job=key[1], error=str(exc), retry_in=delay)
        self.kick(key, 0.2 if conflict else delay)

    def children(self, key: Key) -> list[Child]:
        out: list[Child] = []
        for kind in self.settings.child_kinds():
            index = self.indexes.get(kind)
            if index is not None:
                out.extend(index.get(key, ()))
        return out

    async def list_children(self, key: Key) -> list[Child]:
        """Children straight from the API server (consistent reads): used for cleanup, where a
        lagging index could let an object just created escape deletion."""
        namespace, name = key
        selector = f"{naming.LABEL_JOB}={name}"
        out: list[Child] = []
        for row in self.settings.child_kind_rows():
            try:
                items = await self.client.list(path_for(row.api_version, row.kind, namespace), selector)
            except ApiError as exc:
                if exc.status == 404 and row.gate == "kueue":
                    continue  # Kueue is not installed
                raise
            out.extend(summarize(row.kind, item) for item in items)
        return out

    async def reconcile(self, key: Key) -> Plan | None:
        body = self.jobs.get(key)
        if body is None:
            return None
        namespace, name = key
        now = self.clock()
        memory = self.memory.setdefault(key, JobMemory())
        deleting = bool((body.get("metadata") or {}).get("deletionTimestamp"))
        children = await self.list_children(key) if deleting else self.children(key)
        observed = Observed(children=children)
        if not deleting:
            await self._observe_runtime(key, observed)
        result = plan(body, observed, self.settings, now, memory)
        self.memory[key] = result.memory
        bound = structlog.contextvars.bound_contextvars(namespace=namespace, job=name)
        with bound:
            body = await self._write_job(key, body, result)
            if body is None:
                return result
            applied = await apply_plan(
                self.client, result, children, concurrency=self.settings.max_concurrent_writes
            )
            if applied.rejected is not None:
                # The spec renders an object the API server refuses: no retry can fix that. The next
                # plan reports InvalidSpec (naming what was refused) and removes what was created.
                log.warning("invalid spec: a child was refused", error=applied.rejected)
                generation = (body.get("metadata") or {}).get("generation")
                self.memory[key] = replace(self.memory[key], rejected=(generation, applied.rejected))
                self.kick(key)
                return result
            if applied.quota_error is not None:
                refusal = QuotaRefusal(applied.quota_error, applied.quota_required)
                await self._quota_refused(key, body=body, result=result, refusal=refusal, children=children)
            elif applied.created and result.running and result.memory.quota_message is not None:
                # Created without refusal: quota is back.
                self.memory[key] = replace(self.memory[key], quota_message=None, quota_failures=0)
                self.kick(key, 0.5)
            if not applied.quota_required:  # a rollback is reported as QuotaExceeded instead
                await self._report_apply(key, body, applied.created, applied.deleted)
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
            if applied.writes or deleting:
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
            self._store_newer(key, body)
            # Decisions count once: only when the status that records them was written.
            self.metrics.restarts.inc(sum(1 for e in result.events if e.reason == "Restarting"))
            for _, role, before, after in result.scaled:
                self.metrics.scale_decisions.labels(role, "out" if after > before else "in").inc()
        await self._emit(key, body, result.events)
        return body

    def _store_newer(self, key: Key, body: dict[str, Any]) -> None:
        # Our write succeeded against the version we had (resourceVersion precondition), so the
        # answer is at least as new as anything the watch delivered before it.
        if key in self.jobs:
            self.jobs[key] = body

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
            self._store_newer(key, updated)
        return updated

    async def _quota_refused(
        self,
        key: Key,
        *,
        body: dict[str, Any],
        result: Plan,
        refusal: QuotaRefusal,
        children: list[Child],
    ) -> None:
        """All or nothing: a job whose pods do not all fit runs none of them, waits and retries.
        The refusal is an input of the status function, which says so in the status."""
        memory = self.memory[key]
        failures = memory.quota_failures + 1
        delay = min(self.settings.quota_backoff * 2 ** (failures - 1), self.settings.quota_backoff_max)
        retry_at = self.clock().timestamp() + delay if refusal.required else memory.quota_retry_at
        self.memory[key] = replace(
            memory, quota_failures=failures, quota_message=refusal.message, quota_retry_at=retry_at
        )
        namespace = key[0]
        if refusal.required:
            own = {c.name for c in children if c.kind == "Pod" and c.owner_uid == result.ref.uid}
            names = sorted(own | {name for kind, name in result.desired if kind == "Pod"})
            await delete_pods(self.client, namespace, names, concurrency=self.settings.max_concurrent_writes)
        meta = body.get("metadata") or {}
        if result.status_inputs is not None:
            status = active_status(result.status_inputs, refusal).to_k8s()
            patch = patch_for_status(body.get("status") or {}, status, meta.get("resourceVersion"))
            if patch is not None:
                try:
                    updated = await self.client.patch(_rljob_path(*key, "status"), patch)
                    self._store_newer(key, updated)
                except ApiError as exc:
                    if exc.status != 409:
                        raise
        removed = "removed the job's pods, " if refusal.required else ""
        text = f"{refusal.message}; {removed}retrying in {delay:g}s"
        await self._emit(key, body, [Event("Warning", "QuotaExceeded", text)])
        self.kick(key, delay)

    async def _report_apply(
        self, key: Key, body: dict[str, Any], created: list[str], deleted: list[str]
    ) -> None:
        events = []
        pods_created = sorted(n.split("/", 1)[1] for n in created if n.startswith("Pod/"))
        pods_deleted = sorted(n.split("/", 1)[1] for n in deleted if n.startswith("Pod/"))
        if pods_created:
            events.append(
                Event("Normal", "CreatedPods", f"created {len(pods_created)} pods: {', '.join(pods_created)}")
            )
        if pods_deleted:
            events.append(
                Event("Normal", "DeletedPods", f"deleted {len(pods_deleted)} pods: {', '.join(pods_deleted)}")
            )
        if any(n.startswith("Workload/") for n in created):
            events.append(
                Event("Normal", "WorkloadCreated", "created the Kueue Workload; waiting for admission")
            )
        await self._emit(key, body, events)

    async def _emit(self, key: Key, body: dict[str, Any], events: Sequence[Event]) -> None:
        """Kubernetes Events on the RLJob, deduplicated like the event recorder does."""
        if not events:
            return
        seen = self._seen_events.setdefault(key, {})
        now = time.monotonic()
        meta = body.get("metadata") or {}
        stamp = rfc3339(self.clock())
        for event in events:
            if now - seen.get((event.reason, event.message), -1e9) < EVENT_DEDUP_SECONDS:
                continue
            seen[(event.reason, event.message)] = now
            log.info("event", reason=event.reason, type=event.type, message=event.message)
            manifest = {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{key[1]}.{secrets.token_hex(8)}", "namespace": key[0]},
                "involvedObject": {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "name": key[1],
                    "namespace": key[0],
                    "uid": meta.get("uid"),
                },
                "reason": event.reason,
                "message": event.message[:1024],
                "type": event.type,
                "source": {"component": naming.MANAGER},
                "reportingComponent": naming.MANAGER,
                "reportingInstance": self._instance,
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": 1,
            }
            try:
                await self.client.create(path_for("v1", "Event", key[0]), manifest)
            except ApiError as exc:  # events are best effort: never fail a reconcile for one
                log.warning("event not recorded", error=str(exc))

    # ---- runtime observations -------------------------------------------------------------

    async def _observe_runtime(self, key: Key, observed: Observed) -> None:
        body = self.jobs[key]
        uid = (body.get("metadata") or {}).get("uid")
        own = [c for c in observed.children if c.owner_uid == uid]
        coordinator = next((c for c in own if c.kind == "Pod" and c.role == "coordinator"), None)
        if coordinator is not None and coordinator.phase == "Running" and not coordinator.deleting:
            observed.progress, observed.progress_error = await self._progress_of(key)
        workload = next((c for c in own if c.kind == "Workload"), None)
        if workload is not None and workload.workload_status:
            names = admission_flavors({"status": workload.workload_status})
            observed.flavors = {n: await self._flavor(n) for n in sorted(names)}
        live = workload if workload is not None and not workload.deleting else None
        observed.priority = await observe_priority(self.client, body, live, self.settings.kueue.enabled)

    async def _progress_of(self, key: Key) -> tuple[Progress | None, str | None]:
        cached = self._progress.get(key)
        now = time.monotonic()
        if cached is not None and now - cached[0] < self.settings.progress_interval:
            return cached[1], cached[2]
        namespace, name = key
        url = (
            self.settings.progress_url.format(
                job=name, namespace=namespace, service=naming.coordinator_service(name), port=naming.PORT_HTTP
            ).rstrip("/")
            + "/progress"
        )
        progress: Progress | None = None
        error: str | None = None
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.settings.progress_timeout)
            )
        try:
            async with self._http.get(url) as resp:
                if resp.status != 200:
                    error = f"GET {url}: HTTP {resp.status}"
                else:
                    progress = Progress.model_validate_json(await resp.read())
        except (aiohttp.ClientError, TimeoutError, ValidationError) as exc:
            error = f"GET {url}: {type(exc).__name__}: {exc}"
        if error:
            log.info("progress unavailable", namespace=namespace, job=name, error=error)
        self._progress[key] = (now, progress, error)
        # Re-read while training: the autoscaler and status follow the coordinator.
        self.kick(key, self.settings.progress_interval)
        return progress, error

    async def _flavor(self, name: str) -> dict[str, Any]:
        cached = self._flavors.get(name)
        if cached is not None and time.monotonic() - cached[0] < 60:
            return cached[1]
        try:
            obj = await self.client.get(path_for(KUEUE_API_VERSION, "ResourceFlavor", None, name))
            spec = dict(obj.get("spec") or {})
        except ApiError as exc:
            if exc.status != 404:
                raise
            spec = {}
        self._flavors[name] = (time.monotonic(), spec)
        return spec
