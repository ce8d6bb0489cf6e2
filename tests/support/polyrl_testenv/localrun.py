"""`polyrl run` as a user runs it: the installed command in a child process, and its result files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

POLYRL = str(Path(sys.executable).parent / "polyrl")


def run_env() -> dict[str, str]:
    """This environment with what the suite runs every job under (explicit settings win)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "polyrl" / "torch_extensions"))
    return env


def write_job(doc: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def polyrl_run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`polyrl run ARGS`, its output captured, whatever its exit status."""
    return subprocess.run(
        [POLYRL, "run", *args], capture_output=True, text=True, timeout=timeout, env=run_env(), check=False
    )


def run_to_end(job: Path, out: Path, *flags: str, timeout: float = 600) -> dict[str, Any]:
    """Run `job` into `out` and require success; its `summary.json`."""
    r = polyrl_run(str(job), "--out", str(out), *flags, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def metrics_rows(out: Path) -> list[dict[str, Any]]:
    """The run's `metrics.jsonl`, one dict per policy step."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
