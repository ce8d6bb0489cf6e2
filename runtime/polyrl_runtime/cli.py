"""Command lines: `polyrl run FILE` (registered into the operator's `polyrl` through the
`polyrl.commands` entry point) and `polyrl-runtime coordinator|worker` (what the pods run)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyrl_operator import pod_contract as contract


def _cmd_run(args: argparse.Namespace) -> int:
    from polyrl_runtime.cpusets import CpuSetError, parse_cpu_sets
    from polyrl_runtime.local.run import run_local

    try:
        cpu_sets = parse_cpu_sets(args.cpus or [])
    except CpuSetError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    return run_local(
        args.file,
        args.out,
        resume=args.resume,
        port=args.port,
        quiet=args.quiet,
        live=False if args.plain else None,
        cpu_sets=cpu_sets,
        colocate=not args.separate,
    )


def register(subparsers: Any) -> None:
    """Entry point (`polyrl.commands`): adds `polyrl run`."""
    run = subparsers.add_parser(
        "run", help="run an RLJob on this machine (local Ray, CPU), with live progress and plots"
    )
    run.add_argument("file", metavar="FILE", help="RLJob manifest (YAML or JSON)")
    run.add_argument("--out", help="output folder (default: runs/<job name>)")
    run.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in the output folder"
    )
    run.add_argument("--port", type=int, help="also serve /progress on 127.0.0.1:PORT")
    run.add_argument("--plain", action="store_true", help="plain progress lines instead of a live table")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress output, only the summary")
    run.add_argument(
        "--cpus",
        action="append",
        metavar="ROLE=CPUS",
        help="pin a role's actors to CPUs, e.g. --cpus rollout=0 --cpus workflow=0 --cpus trainer=1 "
        "(roles: rollout, workflow, trainer; Linux). Gives each role its own cores, as pods have; "
        "by default every actor shares every core. pool:NAME=CPUS pins every role placed on device "
        "pool NAME (spec.pools), whose cores they share; ROLE=CPUS pins only the roles on pods of "
        "their own",
    )
    run.add_argument(
        "--separate",
        action="store_true",
        help="give each policy's trainer and engines processes of their own (by default a CPU "
        "policy's one-rank trainer and its first torch engine share one, which starts faster)",
    )
    run.set_defaults(func=_cmd_run)


def _cmd_create_tiny(args: argparse.Namespace) -> int:
    from polyrl_runtime.models.tiny_qwen2 import SIZES, create_tiny_qwen2

    if args.name not in SIZES:
        sys.stderr.write(f"error: unknown model {args.name!r}; known: {', '.join(sorted(SIZES))}\n")
        return 2
    out = create_tiny_qwen2(args.directory, name=args.name, seed=args.seed)
    sys.stdout.write(f"wrote {out} (load it with model.uri: file://{out.resolve()})\n")
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from polyrl_runtime.models import ModelLoadError, local_path, packaged_gguf
    from polyrl_runtime.models.gguf import convert

    src: str = args.source
    dst: Path = args.directory
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        sys.stderr.write(f"error: {dst} exists and is not an empty directory; name a new one\n")
        return 2
    uri = src if "://" in src else f"file://{Path(src).resolve()}"
    try:
        if uri.startswith("builtin://"):
            path = packaged_gguf(uri.removeprefix("builtin://"))
        else:
            path = local_path(uri)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
        try:
            convert(path, tmp, uri, final=dst)
            if dst.exists():
                dst.rmdir()
            tmp.rename(dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except ModelLoadError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    sys.stdout.write(f"wrote {dst} (load it with model.uri: file://{dst.resolve()})\n")
    return 0


def register_models(subparsers: Any) -> None:
    """Entry point (`polyrl.commands`): adds `polyrl models create-tiny DIR` and
    `polyrl models import SRC.gguf DIR`."""
    models = subparsers.add_parser(
        "models", help="build the small Hugging Face models of the examples, or convert a GGUF file"
    )
    sub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    imp = sub.add_parser(
        "import",
        help="convert a GGUF model file (a path, file://, pvc://, s3:// or a packaged builtin:// "
        "model) into a Hugging Face model directory DIR: float32 safetensors, config, tokenizer and "
        "chat template",
    )
    imp.add_argument("source", metavar="SRC")
    imp.add_argument("directory", metavar="DIR", type=Path)
    imp.set_defaults(func=_cmd_import)
    tiny = sub.add_parser(
        "create-tiny",
        help="write a tiny Qwen2 (safetensors weights, a BPE tokenizer with a chat template) to DIR, "
        "an ordinary Hugging Face model directory",
    )
    tiny.add_argument("directory", metavar="DIR", type=Path)
    tiny.add_argument("--name", default="tiny-qwen2", help="which built-in size (default tiny-qwen2)")
    tiny.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    tiny.set_defaults(func=_cmd_create_tiny)


def _cmd_coordinator(args: argparse.Namespace) -> int:
    from polyrl_runtime.pods.entry import run_coordinator

    return run_coordinator(args.config, out=args.out, ray_port=args.ray_port, http_port=args.http_port)


def _cmd_worker(args: argparse.Namespace) -> int:
    from polyrl_runtime.pods.entry import run_worker

    return run_worker(
        args.config,
        role=args.role,
        policy=args.policy,
        pool=args.pool,
        address=args.address,
        http_port=args.http_port,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyrl-runtime", description="polyrl runtime entry points for pods."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    http_port = f"{contract.ENV_HTTP_PORT} or {contract.PORT_HTTP}"
    c = sub.add_parser("coordinator", help="start the Ray head and run the job's driver")
    c.add_argument("--config", required=True, help=f"RLJob file (the pod's {contract.ENV_CONFIG})")
    c.add_argument("--out", default=None, help="local state folder (default: /tmp/polyrl/<job>)")
    c.add_argument(
        "--ray-port", type=int, default=None, help=f"Ray GCS port (default {contract.PORT_RAY_GCS})"
    )
    c.add_argument("--http-port", type=int, default=None, help=f"/progress port (default: {http_port})")
    c.set_defaults(func=_cmd_coordinator)
    w = sub.add_parser("worker", help="join the coordinator's Ray cluster as one role's node and wait")
    w.add_argument("--config", required=True, help=f"RLJob file (the pod's {contract.ENV_CONFIG})")
    w.add_argument("--role", required=True, choices=["rollout", "trainer", "workflow", "pool"])
    w.add_argument("--policy", default=None, help="policy name (rollout and trainer roles)")
    w.add_argument(
        "--pool",
        default=None,
        help=f"device pool name (role pool; default: {contract.ENV_POOL}): the pod offers every role "
        "placed on the pool",
    )
    w.add_argument(
        "--address", default=None, help=f"Ray head address (default: {contract.ENV_COORDINATOR_ADDRESS})"
    )
    w.add_argument("--http-port", type=int, default=None, help=f"/healthz port (default: {http_port})")
    w.set_defaults(func=_cmd_worker)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A pod's process logs JSON (POLYRL_LOG_FORMAT may ask for console) and says that it started
    # before it imports pydantic, aiohttp or Ray, or takes any lock.
    from polyrl_runtime.logs import LogConfigError, configure_logging, started

    try:
        configure_logging("json")
    except LogConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    started(
        args.command,
        role=getattr(args, "role", None) or "coordinator",
        policy=getattr(args, "policy", None),
        pool=getattr(args, "pool", None),
    )
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
