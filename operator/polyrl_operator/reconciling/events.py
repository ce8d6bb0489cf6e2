"""The event recorder: Kubernetes Events on an RLJob, deduplicated as client-go's recorder does.

An event with the same reason and message as one recorded for the same job within
``EVENT_DEDUP_SECONDS`` is dropped, so a level-based loop that takes the same decision on every
pass does not flood the namespace. Events are best effort: a refused one is logged, never raised.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import structlog

from polyrl_operator import naming
from polyrl_operator.api import API_VERSION, KIND
from polyrl_operator.kube import ApiError, KubeClient, path_for
from polyrl_operator.planning import Event
from polyrl_operator.planning.conditions import rfc3339
from polyrl_operator.reconciling.queue import Key

log = structlog.get_logger("polyrl.reconcile")

EVENT_DEDUP_SECONDS = 300.0


class EventRecorder:
    def __init__(self, client: KubeClient, clock: Callable[[], datetime]) -> None:
        self.client = client
        self.clock = clock
        self._seen: dict[Key, dict[tuple[str, str], float]] = {}
        """(reason, message) -> monotonic time last recorded, per job."""
        self._instance = socket.gethostname()

    def forget(self, key: Key) -> None:
        self._seen.pop(key, None)

    async def record(self, key: Key, body: dict[str, Any], events: Sequence[Event]) -> None:
        """Record ``events`` on the RLJob ``body`` (its uid names the involved object)."""
        if not events:
            return
        seen = self._seen.setdefault(key, {})
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


def apply_events(created: Sequence[str], deleted: Sequence[str]) -> list[Event]:
    """Events for what apply created and deleted (``Kind/name`` each)."""
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
        events.append(Event("Normal", "WorkloadCreated", "created the Kueue Workload; waiting for admission"))
    return events
