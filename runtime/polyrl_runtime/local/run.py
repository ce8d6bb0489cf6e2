"""`polyrl run FILE`: run an RLJob on this machine with a local Ray, live progress and result files.

Output folder (default `runs/<job name>`): `metrics.jsonl` (one row per policy step, appended live),
`metrics.csv`, `reward_<policy>.png`, `summary.json`, `checkpoints/` (periodic and final).
`--resume` continues from the latest checkpoint there; Ctrl-C stops after the steps in progress,
writes a checkpoint and the result files, and exits 130.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog

from polyrl_operator.api import RLJob
from polyrl_runtime.config import JobFileError, load_job, placement_resources, set_env_defaults
from polyrl_runtime.coordinator.checkpoint import CheckpointStore, checkpoint_root
from polyrl_runtime.coordinator.driver import Driver, DriverOptions
from polyrl_runtime.coordinator.metrics_files import read_metrics
from polyrl_runtime.coordinator.report import RunSummary
from polyrl_runtime.cpusets import format_cpus
from polyrl_runtime.local.display import ProgressDisplay
from polyrl_runtime.local.plots import reward_curves, write_csv
from polyrl_runtime.logs import LogConfigError, configure_logging

log = structlog.get_logger(__name__)


def local_resources(job: RLJob) -> dict[str, float]:
    """The custom resources a one-machine cluster offers: as many units as the spec's replicas."""
    return placement_resources(job)


def init_local_ray(job: RLJob) -> None:
    import ray

    cwd = os.getcwd()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, os.environ.get("PYTHONPATH")]))
    ray.init(
        address="local",  # always a private cluster, never one `ray start` left on this machine
        num_cpus=os.cpu_count() or 2,
        resources=local_resources(job),
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
        configure_logging=True,
    )


def _prepare_out(out: Path, resume: bool, job: RLJob) -> Path | str:
    """The checkpoint root; a fresh run clears the previous run's results first. The metrics series
    (`metrics.jsonl`) is the driver's: it continues it after the checkpoint it resumes from."""
    root = checkpoint_root(job.spec.checkpoint.uri, out)
    out.mkdir(parents=True, exist_ok=True)
    if resume:
        if CheckpointStore(root, job.spec.checkpoint.keep).latest() is None:
            raise JobFileError(f"--resume: no checkpoint in {root}")
    else:
        for name in ("metrics.jsonl", "metrics.csv", "summary.json"):
            (out / name).unlink(missing_ok=True)
        for png in out.glob("reward_*.png"):
            png.unlink()
        if root == out / "checkpoints" and root.exists():
            shutil.rmtree(root)
    return root


TAIL_STEPS = 10  # the summary's "last steps" mean: one step's 64 episodes are a noisy reading


def tail_means(rows: list[dict[str, Any]], policy: str, n: int = TAIL_STEPS) -> dict[str, Any]:
    """Mean reward and success of `policy` over its last `n` steps (fewer if it has fewer)."""
    tail = [r for r in rows if r["policy"] == policy][-n:]
    out: dict[str, Any] = {"steps": len(tail)}
    for key in ("reward_mean", "success_mean"):
        vals = [float(r[key]) for r in tail if r.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals else None
    return out


def _with_tail(text: str, tail: dict[str, Any], key: str, fmt: str) -> str:
    value = tail.get(key)
    if tail["steps"] > 1 and value is not None:
        return f"{text} (mean of the last {tail['steps']} steps: {value:{fmt}})"
    return text


def _print_summary(
    display: ProgressDisplay, s: RunSummary, out: Path, pngs: list[Path], tails: dict[str, dict[str, Any]]
) -> None:
    w = display.message
    w("")
    w(f"== {s.state}: {s.message} ({s.wall_s:.0f}s, {s.episodes} episodes)")
    for p, step in s.steps.items():
        first, last = display.first.get(p), display.latest.get(p)
        tail = tails.get(p, {"steps": 0})
        f = "-" if first is None or first.reward_mean is None else f"{first.reward_mean:.3f}"
        lst = "-" if last is None or last.reward_mean is None else f"{last.reward_mean:.3f}"
        lst = _with_tail(lst, tail, "reward_mean", ".3f")
        succ = ""
        if first and last and first.success_mean is not None and last.success_mean is not None:
            succ = f", success {first.success_mean:.2f} -> {last.success_mean:.2f}"
            succ = _with_tail(succ, tail, "success_mean", ".2f")
        dropped = ", ".join(f"{k} {v}" for k, v in s.dropped.get(p, {}).items() if v) or "none"
        w(f"   {p}: {step} steps, reward {f} -> {lst}{succ}; dropped samples: {dropped}")
    if s.failed:
        w("   failed episodes: " + ", ".join(f"{k} {v}" for k, v in s.failed.items()))
    w(f"   metrics: {out / 'metrics.csv'}, {out / 'metrics.jsonl'}")
    for png in pngs:
        w(f"   plot:    {png}")
    if s.checkpoint:
        w(f"   checkpoint: {s.checkpoint}")


async def _drive(driver: Driver, port: int | None) -> RunSummary:
    loop = asyncio.get_running_loop()
    presses = 0

    def on_sigint() -> None:
        nonlocal presses
        presses += 1
        if presses > 1:
            os._exit(130)
        driver.stop("interrupted (Ctrl-C): checkpointing; press Ctrl-C again to quit at once")

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    loop.add_signal_handler(signal.SIGTERM, on_sigint)
    server = None
    if port is not None:
        from polyrl_runtime.coordinator.progress_server import ProgressServer

        server = ProgressServer(driver, "127.0.0.1", port)
        await server.start()
    try:
        return await driver.run()
    finally:
        if server is not None:
            await server.stop()


def run_local(
    job_file: str,
    out: str | None = None,
    *,
    resume: bool = False,
    port: int | None = None,
    quiet: bool = False,
    live: bool | None = None,
    cpu_sets: dict[str, frozenset[int]] | None = None,
) -> int:
    try:
        configure_logging("console")  # a person at a terminal; POLYRL_LOG_FORMAT=json overrides
    except LogConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    set_env_defaults()
    try:
        job = load_job(job_file)
        out_dir = Path(out or Path("runs") / job.metadata.name)
        root = _prepare_out(out_dir, resume, job)
    except (JobFileError, ValueError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    import ray

    init_local_ray(job)
    display = ProgressDisplay(
        [p.name for p in job.spec.policies], job.spec.training.total_steps, live=live, quiet=quiet
    )
    pinned = "".join(f", {role} on CPU {format_cpus(c)}" for role, c in (cpu_sets or {}).items())

    def on_event(kind: str, data: dict[str, Any]) -> None:
        if kind == "started":
            display.message(
                f"running {job.metadata.name}: policies {', '.join(data['policies'])} "
                f"({job.spec.mode}, maxStaleness {job.spec.effective_max_staleness}{pinned}) -> {out_dir}"
            )
        elif kind == "checkpoint" and data["reason"] != "periodic":
            display.message(f"checkpoint ({data['reason']}): {data['path']}")
        elif kind in ("engine_lost", "engine_added", "worker_lost", "worker_added", "drain"):
            display.message(f"{kind}: {data}")

    opts = DriverOptions(
        out_dir=out_dir,
        checkpoint_root=root,
        resume=resume,
        on_record=display.record,
        metrics_dir=out_dir,  # metrics.jsonl beside the other results (coordinator/metrics_files.py)
        on_event=on_event,
        cpu_sets=dict(cpu_sets or {}),
    )
    driver = Driver(job, opts)
    try:
        with display:
            summary = asyncio.run(_drive(driver, port))
    finally:
        ray.shutdown()
    rows = read_metrics(out_dir)
    write_csv(out_dir / "metrics.csv", rows)
    pngs = reward_curves(out_dir, rows)
    tails = {p: tail_means(rows, p) for p in summary.steps}
    doc = asdict(summary)
    doc.pop("records")
    doc["last_steps_mean"] = tails
    (out_dir / "summary.json").write_text(json.dumps(doc, indent=1, default=str))
    _print_summary(display, summary, out_dir, pngs, tails)
    if summary.state == "failed":
        sys.stderr.write(f"error: {summary.message}\n")
        return 1
    return 130 if driver.interrupted else 0
