"""`polyrl run FILE`: run an RLJob on this machine with a local Ray, live progress and result files.

Output folder (default `runs/<job name>`): `metrics.jsonl` (one row per policy step, appended live),
`metrics.csv`, `reward_<policy>.png`, `summary.json`, `checkpoints/` (periodic and final); a run
that fails before it started changes none of them (local/results.py). `--resume` continues from the
latest checkpoint there. Ctrl-C stops after the steps in progress, writes a checkpoint and the result
files, and exits 130; a second Ctrl-C exits 130 at once (local/interrupts.py).

While it starts, the run says what it is doing (Ray, actors, models, trainers, first weights) and
the summary gives each start-up phase's duration (coordinator/metrics/startup.py `StartupPhases`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from polyrl_operator.api import RLJob
from polyrl_runtime.config import JobFileError, load_job, placement_resources, set_env_defaults
from polyrl_runtime.coordinator.checkpoints.store import CheckpointStore, checkpoint_root
from polyrl_runtime.coordinator.metrics.startup import StartupPhases
from polyrl_runtime.coordinator.report import RunSummary
from polyrl_runtime.cpusets import check_pools, format_cpus
from polyrl_runtime.local.display import ProgressDisplay, use_colour, write
from polyrl_runtime.local.interrupts import EXIT_INTERRUPTED, Interrupts
from polyrl_runtime.local.results import clear_previous, summary_lines, write_results
from polyrl_runtime.logs import LogConfigError, configure_logging
from polyrl_runtime.workflows.preflight import PreflightError, check_entry_points

if TYPE_CHECKING:
    from polyrl_runtime.coordinator.driver import Driver

log = structlog.get_logger(__name__)


def local_resources(job: RLJob) -> dict[str, float]:
    """The custom resources a one-machine cluster offers: as many units as the spec's replicas (a
    pooled role's as its pool's pods at replicas.min would offer, `placement_resources`)."""
    return placement_resources(job)


def role_pools(job: RLJob) -> list[tuple[str, str, str | None]]:
    """(policy, role, its pool or None) for every policy's rollout and trainer (`check_pools`)."""
    return [
        (p.name, role, r.pool)
        for p in job.spec.policies
        for role, r in (("rollout", p.rollout), ("trainer", p.trainer))
        if role == "rollout" or not p.frozen
    ]


def import_from_cwd() -> None:
    """Let this process import the job's code from the current directory, as the local Ray workers
    do (`init_local_ray` puts it first on their PYTHONPATH): the start-up checks import what they do."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


DRIVER_MODULE = "polyrl_runtime.coordinator.driver"


def import_in_background(module: str) -> threading.Thread:
    """Import `module` on a thread. The driver's modules (torch among them: about 2 s of CPU) load
    while `ray.init` waits on the processes it starts, which leaves a core idle. A module that fails
    to import fails again, with its own error, where the main thread imports it."""

    def load() -> None:
        with contextlib.suppress(Exception):
            importlib.import_module(module)

    thread = threading.Thread(target=load, name=f"import {module}", daemon=True)
    thread.start()
    return thread


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def gpu_shortage(job: RLJob, available: float) -> str | None:
    """Why the job's actors can never all start on a machine whose Ray sees `available` GPUs (Ray
    would keep them pending, and the job would wait for them forever), or None. Each dedicated
    engine asks for its rollout's `gpus`, each dedicated trainer rank for one; pooled roles share
    their pool's devices and ask for none (`coordinator.placement.ray_gpus`)."""
    needs: list[tuple[str, int]] = []
    for p in job.spec.policies:
        rollout, trainer = job.spec.rollout_placement(p), job.spec.trainer_placement(p)
        if rollout.pool is None and rollout.gpus:
            needs.append(
                (
                    f"policy {p.name}: rollout.gpus {rollout.gpus} x {rollout.min_replicas} engines",
                    rollout.gpus * rollout.min_replicas,
                )
            )
        if trainer.pool is None and trainer.gpus:
            needs.append(
                (
                    f"policy {p.name}: trainer.gpus {trainer.gpus} ({_count(trainer.trainer_world, 'rank')})",
                    trainer.trainer_world,
                )
            )
    total = sum(n for _, n in needs)
    if total <= available:
        return None
    have = "no GPU" if not available else _count(int(available), "GPU")
    return (
        f"the job needs {_count(total, 'GPU')} and this machine has {have}: "
        + "; ".join(w for w, _ in needs)
        + " (gpus is 1 unless set: set gpus: 0 on each role to run on CPU)"
    )


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
    """The checkpoint root (checked to hold a checkpoint to resume from). Nothing is removed yet: a
    fresh run clears the previous results once it has started (results.py `clear_previous`)."""
    root = checkpoint_root(job.spec.checkpoint.uri, out)
    out.mkdir(parents=True, exist_ok=True)
    if resume and CheckpointStore(root, job.spec.checkpoint.keep).latest() is None:
        raise JobFileError(f"--resume: no checkpoint in {root}")
    return root


async def _drive(driver: Driver, port: int | None, interrupts: Interrupts) -> RunSummary:
    interrupts.running(asyncio.get_running_loop(), driver.stop)
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


def _errors(message: str) -> int:
    for line in message.splitlines():
        sys.stderr.write(f"error: {line}\n")
    return 2


def run_local(
    job_file: str,
    out: str | None = None,
    *,
    resume: bool = False,
    port: int | None = None,
    quiet: bool = False,
    live: bool | None = None,
    cpu_sets: dict[str, frozenset[int]] | None = None,
    colocate: bool = True,
) -> int:
    colour = use_colour(live, os.environ, sys.stdout)
    try:
        # A person at a terminal; POLYRL_LOG_FORMAT=json overrides.
        configure_logging("console", colors=colour)
    except LogConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    set_env_defaults()
    try:
        job = load_job(job_file)
        check_pools(cpu_sets or {}, job.spec.pool_names, role_pools(job))
        import_from_cwd()
        check_entry_points(job.spec)  # before Ray: a job whose code does not import never starts
        out_dir = Path(out or Path("runs") / job.metadata.name)
        root = _prepare_out(out_dir, resume, job)
    except PreflightError as e:
        sys.stderr.write(f"error: {job_file}: {e}\n")
        return 2
    except (JobFileError, ValueError) as e:
        return _errors(str(e))
    import ray

    display = ProgressDisplay(
        [p.name for p in job.spec.policies],
        job.spec.training.total_steps,
        live=live,
        quiet=quiet,
        colour=colour,
    )
    interrupts = Interrupts(display.message)
    startup = StartupPhases()
    started = False
    pinned = "".join(f", {role} on CPU {format_cpus(c)}" for role, c in (cpu_sets or {}).items())

    def on_event(kind: str, data: dict[str, Any]) -> None:
        nonlocal started
        if kind == "startup":
            display.message(f"{data['doing']} ...")
        elif kind == "started":
            started = True
            clear_previous(out_dir, root, fresh=not resume)
            display.message(
                f"running {job.metadata.name}: policies {', '.join(data['policies'])} "
                f"({job.spec.mode}, maxStaleness {job.spec.effective_max_staleness}{pinned}) -> {out_dir}"
            )
            display.message(f"start-up: {startup.describe()}")
        elif kind == "checkpoint" and data["reason"] != "periodic":
            display.message(f"checkpoint ({data['reason']}): {data['path']}")
        elif kind in ("engine_lost", "engine_added", "worker_lost", "worker_added", "drain"):
            display.message(f"{kind}: {data}")

    with interrupts.installed():
        display.message(f"starting {job.metadata.name}: a local Ray cluster ...")
        try:
            driver_import = import_in_background(DRIVER_MODULE)
            with startup.timed("ray"):
                init_local_ray(job)
            cluster: Any = ray
            shortage = gpu_shortage(job, cluster.cluster_resources().get("GPU", 0.0))
            if shortage is not None:
                return _errors(f"{job_file}: {shortage}")
            driver_import.join()
            from polyrl_runtime.coordinator.driver import Driver, DriverOptions

            opts = DriverOptions(
                out_dir=out_dir,
                checkpoint_root=root,
                resume=resume,
                on_record=display.record,
                metrics_dir=out_dir,  # metrics.jsonl beside the other results (coordinator/metrics/files.py)
                on_event=on_event,
                cpu_sets=dict(cpu_sets or {}),
                colocate=colocate,
                startup=startup,
            )
            driver = Driver(job, opts)
            with display:
                summary = asyncio.run(_drive(driver, port, interrupts))
            interrupts.ended()
        finally:
            ray.shutdown()
        results = write_results(out_dir, summary, started=started)
    for line in summary_lines(summary, results):
        write(line)  # --quiet too: it prints only the summary
    if summary.state == "failed":
        sys.stderr.write(f"error: {summary.message}\n")
        return 1
    return EXIT_INTERRUPTED if driver.interrupted else 0
