"""The ``polyrl`` command line: ``crds generate|check``, ``validate FILE...``, ``operator`` and
``render FILE``.

Subcommands of other distributions (the runtime's ``polyrl run``) plug in through the
``polyrl.commands`` entry-point group, so this package never imports them directly. ``polyrl
operator`` starts kopf in ``cmd_operator``; the kopf machinery is imported only there, so the other
subcommands start fast and need no cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import structlog
import yaml

from polyrl_operator import crdgen
from polyrl_operator.api import KIND
from polyrl_operator.planning import render
from polyrl_operator.settings import OperatorSettings, load_settings
from polyrl_operator.validation import load_documents, validate_file


def _out(line: str) -> None:
    sys.stdout.write(line + "\n")


def _err(line: str) -> None:
    sys.stderr.write(line + "\n")


# Every committed copy of the CRD, relative to the repository root: the kustomize base and the chart
# vendor it, so that each install is self-contained.
CRD_DIRS = ("crds", "charts/polyrl/crds", "manifests/base/crds")


def _cmd_crds(args: argparse.Namespace) -> int:
    directories = [Path(d) for d in (args.dir or CRD_DIRS)]
    if args.action == "generate":
        for directory in directories:
            _out(f"wrote {crdgen.generate(directory)}")
        return 0
    problems = [problem for directory in directories for problem in crdgen.check(directory)]
    for problem in problems:
        _err(problem)
    if not problems:
        for directory in directories:
            _out(f"{directory / crdgen.CRD_FILENAME}: up to date")
    return 1 if problems else 0


def _cmd_validate(args: argparse.Namespace) -> int:
    files: list[Path] = []
    for name in args.files:
        path = Path(name)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.suffix in {".yaml", ".yml"}))
        else:
            files.append(path)
    bad = 0
    for path in files:
        report = validate_file(path)
        for problem in report.problems:
            _err(str(problem))
        if report.problems:
            bad += 1
        elif not args.quiet:
            _out(f"{path}: ok ({report.rljobs} RLJob{'s' if report.rljobs != 1 else ''})")
    if bad:
        _err(f"{bad} of {len(files)} file(s) invalid")
    return 1 if bad else 0


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


def _cmd_render(args: argparse.Namespace) -> int:
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
    from polyrl_operator.leader import lead
    from polyrl_operator.metrics import Metrics
    from polyrl_operator.reconciling import Reconciler

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

    async def main() -> int:
        reconciler = Reconciler(KubeClient(credentials), settings, Metrics())
        registry = build_registry(
            reconciler, credentials=credentials, metrics_port=settings.metrics_port, scanning=not exact
        )
        # With leaderElection on, kopf runs only while this replica holds the Lease.
        return await lead(
            settings,
            credentials,
            lambda: kopf.operator(
                registry=registry,
                clusterwide=not namespaces,
                namespaces=namespaces,
                standalone=True,
                liveness_endpoint=liveness or None,
            ),
            liveness=liveness or None,
        )

    return asyncio.run(main())


def _add_operator_commands(sub: Any) -> None:
    """``operator`` and ``render``."""
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
    rd.set_defaults(func=_cmd_render)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polyrl", description="Multi-policy RL jobs on Kubernetes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    crds = sub.add_parser("crds", help="generate or check the CRDs derived from the API models")
    crds.add_argument("action", choices=["generate", "check"])
    crds.add_argument(
        "--dir",
        action="append",
        help=f"a directory holding the CRD file; repeatable (default: {', '.join(CRD_DIRS)})",
    )
    crds.set_defaults(func=_cmd_crds)

    validate = sub.add_parser("validate", help="validate RLJob manifests (files or directories)")
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    validate.set_defaults(func=_cmd_validate)

    _add_operator_commands(sub)

    for ep in entry_points(group="polyrl.commands"):
        register = ep.load()
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
