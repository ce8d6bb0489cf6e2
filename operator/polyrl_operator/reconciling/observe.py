"""The gathering of observations: everything one reconcile of one job reads, as one typed value.

The RLJob comes from the cache the watch keeps (``update_job``), its children from kopf's indexes
(no API call) or, while the job is being deleted, straight from the API server. A running
coordinator's ``/progress`` is read at most every ``progress_interval``; Kueue's ResourceFlavors
(for an admitted Workload's placement) at most every minute; the job's priority class as Kueue
resolves it on every pass.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from pydantic import ValidationError

from polyrl_operator import naming
from polyrl_operator.api.progress import Progress
from polyrl_operator.builders.workload import admission_flavors
from polyrl_operator.kinds import KUEUE_API_VERSION
from polyrl_operator.kube import ApiError, KubeClient, path_for
from polyrl_operator.observed import Child, Observed, summarize
from polyrl_operator.pod_contract import PORT_HTTP
from polyrl_operator.priority import observe_priority
from polyrl_operator.reconciling.queue import Key
from polyrl_operator.settings import OperatorSettings

log = structlog.get_logger("polyrl.reconcile")

Index = Mapping[Key, Iterable[Child]]
FLAVOR_TTL_SECONDS = 60.0


@dataclass(frozen=True)
class Observation:
    """One job as one reconcile sees it."""

    body: dict[str, Any]
    """The RLJob as last seen."""
    observed: Observed
    deleting: bool
    """The job has a deletionTimestamp: its children were listed from the API server."""
    look_again: float | None = None
    """Seconds after which to reconcile again, to follow the coordinator's report (set when it was
    read now rather than from the cache)."""


@dataclass(frozen=True)
class ProgressReading:
    progress: Progress | None
    error: str | None
    fresh: bool
    """Read from the coordinator now, not from the cache."""


class Observer:
    def __init__(self, client: KubeClient, settings: OperatorSettings) -> None:
        self.client = client
        self.settings = settings
        self.jobs: dict[Key, dict[str, Any]] = {}
        """RLJobs as the watch (or our own writes) last delivered them."""
        self.indexes: dict[str, Index] = {}
        """Child summaries by kind, keyed (namespace, job): kopf's live index views."""
        self._progress: dict[Key, tuple[float, Progress | None, str | None]] = {}
        self._flavors: dict[str, tuple[float, dict[str, Any]]] = {}
        self._http: aiohttp.ClientSession | None = None

    def update_job(self, body: dict[str, Any]) -> Key:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        self.jobs[key] = body
        return key

    def forget_job(self, key: Key) -> None:
        self.jobs.pop(key, None)
        self._progress.pop(key, None)

    def store_newer(self, key: Key, body: dict[str, Any]) -> None:
        """Keep the answer of our own write: it succeeded against the version we had
        (resourceVersion precondition), so it is at least as new as anything the watch delivered."""
        if key in self.jobs:
            self.jobs[key] = body

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def observe(self, key: Key) -> Observation | None:
        """The job and all it is planned from; None when the job is not (or no longer) known."""
        body = self.jobs.get(key)
        if body is None:
            return None
        deleting = bool((body.get("metadata") or {}).get("deletionTimestamp"))
        if deleting:
            return Observation(body, Observed(children=await self.list_children(key)), deleting=True)
        observed = Observed(children=self.children(key))
        uid = (body.get("metadata") or {}).get("uid")
        own = [c for c in observed.children if c.owner_uid == uid]
        look_again: float | None = None
        coordinator = next((c for c in own if c.kind == "Pod" and c.role == "coordinator"), None)
        if coordinator is not None and coordinator.phase == "Running" and not coordinator.deleting:
            reading = await self.progress_of(key)
            observed.progress, observed.progress_error = reading.progress, reading.error
            if reading.fresh:
                # Read again while training: the autoscaler and status follow the coordinator.
                look_again = self.settings.progress_interval
        workload = next((c for c in own if c.kind == "Workload"), None)
        if workload is not None and workload.workload_status:
            names = admission_flavors({"status": workload.workload_status})
            observed.flavors = {n: await self._flavor(n) for n in sorted(names)}
        live = workload if workload is not None and not workload.deleting else None
        observed.priority = await observe_priority(self.client, body, live, self.settings.kueue.enabled)
        return Observation(body, observed, deleting=False, look_again=look_again)

    def children(self, key: Key) -> list[Child]:
        """The job's children as kopf's indexes hold them."""
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

    async def progress_of(self, key: Key) -> ProgressReading:
        """The coordinator's ``/progress``, from the cache when younger than ``progress_interval``."""
        cached = self._progress.get(key)
        now = time.monotonic()
        if cached is not None and now - cached[0] < self.settings.progress_interval:
            return ProgressReading(cached[1], cached[2], fresh=False)
        namespace, name = key
        url = (
            self.settings.progress_url.format(
                job=name, namespace=namespace, service=naming.coordinator_service(name), port=PORT_HTTP
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
        return ProgressReading(progress, error, fresh=True)

    async def _flavor(self, name: str) -> dict[str, Any]:
        cached = self._flavors.get(name)
        if cached is not None and time.monotonic() - cached[0] < FLAVOR_TTL_SECONDS:
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
