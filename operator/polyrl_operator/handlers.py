"""Thin kopf handlers: every trigger funnels into ``Reconciler.kick`` (level-based).

* ``@kopf.index`` of each child kind labelled ``polyrl.dev/job`` (pods, services, config maps,
  secrets, Kueue workloads), keyed by (namespace, job) and holding small summaries: plans are
  computed from these with no API call, and kopf starts the handlers only once the indexes are fully
  populated, so a restarted operator never mistakes "not listed yet" for "missing".
* ``@kopf.on.event`` for RLJobs keeps the job cache and kicks; child events kick the owning job.
* The periodic timer is one resync loop (started on startup) instead of ``@kopf.timer``: kopf timers
  put kopf's own finalizer on every object, while this operator's finalizer is part of its plan.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from polyrl_operator import naming
from polyrl_operator.api import GROUP, PLURAL, VERSION
from polyrl_operator.kinds import CHILD_KINDS
from polyrl_operator.kube import Credentials
from polyrl_operator.observed import summarize
from polyrl_operator.reconciling import Reconciler

LABELS = {naming.LABEL_JOB: kopf.PRESENT}


def _key(body: Any) -> tuple[str, str]:
    meta = body.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


def build_registry(
    reconciler: Reconciler,
    *,
    credentials: Credentials | None = None,
    metrics_port: int | None = None,
    scanning: bool = True,
) -> kopf.OperatorRegistry:
    """A kopf registry wired to ``reconciler``; ``credentials`` (else kopf's defaults) for login.

    Only the child kinds the settings enable are indexed and watched (no Kueue Workloads with Kueue
    off), so the operator needs no RBAC for the others. ``scanning=False`` turns off kopf's live
    observation of CRDs and namespaces (cluster-scoped reads): a namespaced install with exact
    namespace names needs neither, and its Roles grant neither."""
    registry = kopf.OperatorRegistry()
    tasks: list[asyncio.Task[None]] = []
    rows = reconciler.settings.child_kind_rows()

    def capture(kwargs: dict[str, Any]) -> None:
        for row in CHILD_KINDS:
            if row.index in kwargs:
                reconciler.indexes[row.kind] = kwargs[row.index]

    for row in rows:
        kind, index_name = row.kind, row.index

        def make_index(kind: str = kind) -> Any:
            def index(body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
                child = summarize(kind, dict(body))
                return {(child.namespace, child.job): child}

            return index

        kopf.index(*row.selector(), id=index_name, labels=LABELS, registry=registry)(make_index())

        def make_child_handler(kind: str = kind) -> Any:
            async def on_child(event: dict[str, Any], **kwargs: Any) -> None:
                capture(kwargs)
                obj = event.get("object") or {}
                namespace, _ = _key(obj)
                job = ((obj.get("metadata") or {}).get("labels") or {}).get(naming.LABEL_JOB)
                if job and (namespace, job) in reconciler.jobs:
                    reconciler.kick((namespace, job))

            return on_child

        kopf.on.event(*row.selector(), id=f"{index_name}_event", labels=LABELS, registry=registry)(
            make_child_handler()
        )

    @kopf.on.event(GROUP, VERSION, PLURAL, id="rljob_event", registry=registry)
    async def on_rljob(event: kopf.RawEvent, **kwargs: Any) -> None:
        capture(kwargs)
        obj: dict[str, Any] = dict(event.get("object") or {})
        key = _key(obj)
        if event.get("type") == "DELETED":
            reconciler.forget_job(key)
            return
        reconciler.update_job(obj)
        reconciler.kick(key)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING
        if not scanning:
            settings.scanning.disabled = True
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.networking.request_timeout = 60
        if metrics_port:
            reconciler.metrics.serve(metrics_port)
        tasks.append(asyncio.create_task(reconciler.resync_forever(), name="polyrl resync"))

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await reconciler.close()
        await reconciler.client.close()

    @kopf.on.probe(id="jobs", registry=registry)
    def probe_jobs(**_: Any) -> int:
        return len(reconciler.jobs)

    if credentials is not None:

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            assert credentials is not None
            return kopf.ConnectionInfo(
                server=credentials.server,
                ca_path=credentials.ca_path,
                insecure=credentials.insecure or None,
                token=credentials.token,
                scheme="Bearer" if credentials.token else None,
                certificate_path=credentials.cert_path,
                private_key_path=credentials.key_path,
            )

    else:
        kopf.on.login(registry=registry)(kopf.login_via_client)
    return registry
