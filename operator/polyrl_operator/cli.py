"""The ``polyrl`` command line: ``crds generate|check``, ``validate FILE...``, ``operator``, ``render FILE``.

Subcommands of other distributions (the runtime's ``polyrl run``) plug in through the
``polyrl.commands`` entry-point group, so this package never imports them directly.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path

from polyrl_operator import crdgen
from polyrl_operator import main as operator_main
from polyrl_operator.validation import validate_file


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

    operator_main.register(sub)

    for ep in entry_points(group="polyrl.commands"):
        register = ep.load()
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
