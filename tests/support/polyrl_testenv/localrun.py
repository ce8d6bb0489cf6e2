"""`polyrl run` as a user runs it: the installed command in a child process, and its result files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
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


def polyrl_run(*args: str, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`polyrl run ARGS` (in `cwd`, where the job's own modules are), its output captured, whatever
    its exit status."""
    return subprocess.run(
        [POLYRL, "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=run_env(),
        check=False,
        cwd=cwd,
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


class Background:
    """`polyrl run ARGS` started in the background, its stdout and stderr going to files in `logs`
    (read while it runs: a pipe nobody reads would block it)."""

    def __init__(self, logs: Path, *args: str) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = logs / "stdout.txt", logs / "stderr.txt"
        with self.stdout_path.open("w") as out, self.stderr_path.open("w") as err:
            self.proc = subprocess.Popen(
                [POLYRL, "run", *args], stdout=out, stderr=err, text=True, env=run_env()
            )

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_until(self, done: Callable[[], bool], what: str, timeout: float = 300) -> None:
        """Poll `done` until it holds; fails (naming `what`) if the run ends first or it times out."""
        deadline = time.monotonic() + timeout
        while not done():
            assert self.proc.poll() is None, (
                f"ended before {what}: {self.stdout[-3000:]}{self.stderr[-3000:]}"
            )
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
            time.sleep(0.2)

    def wait_for_rows(self, out: Path, rows: int) -> None:
        metrics = out / "metrics.jsonl"
        self.wait_until(
            lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= rows, f"{rows} rows"
        )

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
