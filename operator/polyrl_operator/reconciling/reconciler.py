"""The reconciler: the work queue, the observer, the event recorder and one job's reconcile, wired.

kopf delivers RLJob events, child events (through the indexes) and timer ticks; all of them just
``kick`` a job (level-based). A failed reconcile is retried with an exponential backoff per job
(a conflict, 409, at once: the watch brings the newer version).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import structlog

from polyrl_operator.kube import ApiError, KubeClient
from polyrl_operator.metrics import Metrics
from polyrl_operator.planning import Plan
from polyrl_operator.reconciling.events import EventRecorder
from polyrl_operator.reconciling.job import JobReconciler
from polyrl_operator.reconciling.observe import Index, Observer
from polyrl_operator.reconciling.queue import Key, WorkQueue
from polyrl_operator.settings import OperatorSettings

log = structlog.get_logger("polyrl.reconcile")


class Reconciler:
    def __init__(
        self,
        client: KubeClient,
        settings: OperatorSettings,
        metrics: Metrics | None = None,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        observer: Observer | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.observer = observer or Observer(client, settings)
        self.recorder = EventRecorder(client, clock)
        self.job = JobReconciler(
            client,
            settings,
            self.metrics,
            observer=self.observer,
            recorder=self.recorder,
            kick=self.kick,
            clock=clock,
        )
        self.queue = WorkQueue(self._reconcile_safely, concurrency=settings.max_concurrent_reconciles)
        self._errors: dict[Key, int] = {}
        self.reconciles = 0
        """Reconciles run so far (tests and the benchmark count them)."""

    @property
    def jobs(self) -> dict[Key, dict[str, Any]]:
        return self.observer.jobs

    @property
    def indexes(self) -> dict[str, Index]:
        return self.observer.indexes

    def update_job(self, body: dict[str, Any]) -> Key:
        return self.observer.update_job(body)

    def forget_job(self, key: Key) -> None:
        self.observer.forget_job(key)
        self.job.forget(key)
        self.recorder.forget(key)
        self._errors.pop(key, None)
        self.queue.forget(key)

    def kick(self, key: Key, delay: float = 0.0) -> None:
        """Reconcile ``key`` now (or after ``delay``); repeated kicks coalesce."""
        self.queue.kick(key, delay)

    async def reconcile(self, key: Key) -> Plan | None:
        """One reconcile of ``key``, errors raised (the queue runs ``_reconcile_safely``)."""
        return await self.job.reconcile(key)

    async def idle(self) -> None:
        """Wait until no reconcile is running (tests and the benchmark use it)."""
        await self.queue.idle()

    async def close(self) -> None:
        await self.queue.close()
        await self.observer.close()

    async def resync_forever(self) -> None:
        """The periodic timer: every job is reconciled at least every resync_seconds."""
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            for key in list(self.jobs):
                self.kick(key)
            self.metrics.set_jobs((b.get("status") or {}).get("phase", "Pending") for b in self.jobs.values())
            pods = self.indexes.get("Pod") or {}
            self.metrics.set_pods(c.role or "" for children in pods.values() for c in children)

    async def _reconcile_safely(self, key: Key) -> None:
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
