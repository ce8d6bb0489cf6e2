"""``polyrl operator`` (run the kopf operator) and ``polyrl render FILE`` (print what it would create)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
import yaml

from polyrl_operator.api import KIND
from polyrl_operator.plan import plan
from polyrl_operator.settings import OperatorSettings, load_settings
from polyrl_operator.validation import load_documents

RENDER_UID = "00000000-0000-0000-0000-000000000000"
KIND_ORDER = {
    "ServiceAccount": 0,
    "NetworkPolicy": 1,
    "ConfigMap": 2,
    "Secret": 3,
    "Service": 4,
    "Workload": 5,
    "Pod": 6,
}


def configure_logging(verbose: bool = False) -> None:
    """structlog JSON lines for our logs and kopf's (through the stdlib bridge)."""
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.JSONRenderer(),
            ],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def render(
    body: dict[str, Any], settings: OperatorSettings, *, namespace: str = "default"
) -> list[dict[str, Any]]:
    """The manifests the operator creates for ``body`` once it is admitted, in apply order.

    Deterministic (fixed uid, no token, fixed clock) so the output can be diffed in review or GitOps.
    Elastic roles are shown at their minimum replica count; a Kueue job is shown as admitted."""
    from polyrl_operator.observed import Child, Observed

    body = dict(body)
    meta = dict(body.get("metadata") or {})
    meta.setdefault("namespace", namespace)
    meta.setdefault("uid", RENDER_UID)  # a live object's own uid keeps the ownerReferences exact
    meta.update(generation=1, finalizers=["polyrl.dev/cleanup"])
    body["metadata"] = meta
    body.pop("status", None)
    children: list[Child] = []
    scheduling = (body.get("spec") or {}).get("scheduling") or {}
    if scheduling.get("queueName"):
        children.append(
            Child(
                kind="Workload",
                name=meta["name"],
                namespace=meta["namespace"],
                job=meta["name"],
                owner_uid=meta["uid"],
                workload_status={
                    "admission": {"clusterQueue": "", "podSetAssignments": []},
                    "conditions": [{"type": "Admitted", "status": "True"}],
                },
            )
        )
    result = plan(body, Observed(children=children), settings, datetime(2000, 1, 1, tzinfo=UTC))
    failed = [
        c for c in result.status.get("conditions") or [] if c["type"] == "Failed" and c["status"] == "True"
    ]
    if failed:
        raise ValueError(failed[0]["message"])
    manifests = list(result.desired.values())
    for manifest in manifests:
        if manifest["kind"] == "Secret":
            manifest["stringData"] = {"ray-token": "<generated when the Secret is created>"}
    manifests.sort(key=lambda m: (KIND_ORDER.get(m["kind"], 9), m["metadata"]["name"]))
    return manifests


def cmd_render(args: argparse.Namespace) -> int:
    settings = load_settings(Path(args.settings) if args.settings else None)
    docs = []
    bad = 0
    for doc in load_documents(Path(args.file)):
        if not isinstance(doc.body, dict) or doc.body.get("kind") != KIND:
            continue
        try:
            docs.extend(render(doc.body, settings, namespace=args.namespace))
        except ValueError as exc:
            sys.stderr.write(f"{args.file}:{doc.line}: {exc}\n")
            bad += 1
    if docs:
        sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))
    return 1 if bad else 0


def with_own_namespace(settings: OperatorSettings, pod_namespace: str | None) -> OperatorSettings:
    """Fill ``networkPolicy.operatorNamespace`` from the operator pod's own namespace (downward API
    ``POD_NAMESPACE``) when the settings leave it unset."""
    np = settings.network_policy
    if np.operator_namespace or not pod_namespace:
        return settings
    return settings.model_copy(
        update={"network_policy": np.model_copy(update={"operator_namespace": pod_namespace})}
    )


def cmd_operator(args: argparse.Namespace) -> int:
    import kopf

    from polyrl_operator.handlers import build_registry
    from polyrl_operator.kube import KubeClient, load_credentials
    from polyrl_operator.metrics import Metrics
    from polyrl_operator.reconcile import Reconciler

    configure_logging(args.verbose)
    settings = load_settings(Path(args.settings) if args.settings else None)
    if args.metrics_port is not None:
        settings = settings.model_copy(update={"metrics_port": args.metrics_port or None})
    settings = with_own_namespace(settings, os.environ.get("POD_NAMESPACE"))
    credentials = load_credentials(args.kubeconfig, args.context)
    namespaces = list(args.namespace or [])
    # Exact namespace names need no cluster-scoped reads: kopf's live observation of namespaces and
    # CRDs is then off (a namespaced install's Roles do not grant them). Patterns need it.
    exact = bool(namespaces) and not any(set(ns) & set("*?![],") for ns in namespaces)
    liveness = args.liveness
    if liveness is None and settings.liveness_port:
        liveness = f"http://0.0.0.0:{settings.liveness_port}/healthz"

    async def main() -> None:
        reconciler = Reconciler(KubeClient(credentials), settings, Metrics())
        registry = build_registry(
            reconciler, credentials=credentials, metrics_port=settings.metrics_port, scanning=not exact
        )
        await kopf.operator(
            registry=registry,
            clusterwide=not namespaces,
            namespaces=namespaces,
            standalone=True,
            liveness_endpoint=liveness or None,
        )

    asyncio.run(main())
    return 0


def register(sub: Any) -> None:
    """Add ``operator`` and ``render`` to the ``polyrl`` command line."""
    op = sub.add_parser("operator", help="run the RLJob operator (kopf)")
    scope = op.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        metavar="NS",
        help="watch this namespace (repeatable; glob patterns allowed)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (default)")
    op.add_argument(
        "--settings", metavar="FILE", help="operator settings YAML (default images, GPU types, timings)"
    )
    op.add_argument(
        "--kubeconfig", metavar="FILE", help="kubeconfig (default: $KUBECONFIG, ~/.kube/config, in-cluster)"
    )
    op.add_argument("--context", help="kubeconfig context")
    op.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="Prometheus port (0: off; default from settings)"
    )
    op.add_argument(
        "--liveness", metavar="URL", help="liveness endpoint (default http://0.0.0.0:8080/healthz; '' off)"
    )
    op.add_argument("--verbose", "-v", action="store_true")
    op.set_defaults(func=cmd_operator)

    rd = sub.add_parser("render", help="print the manifests the operator would create for an RLJob file")
    rd.add_argument("file", metavar="FILE")
    rd.add_argument("--settings", metavar="FILE", help="operator settings YAML")
    rd.add_argument("--namespace", "-n", default="default", help="namespace for jobs that name none")
    rd.set_defaults(func=cmd_render)
