"""What the training-loop benchmarks share: a local Ray, a job of tiny CPU policies, one driver run."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray

from polyrl_operator.api import RLJob
from polyrl_runtime.config import set_env_defaults
from polyrl_runtime.coordinator.driver import Driver, DriverOptions
from polyrl_runtime.coordinator.report import RunSummary

TINY_POLICY: dict[str, Any] = {
    "model": {"uri": "builtin://tiny"},
    "algorithm": {"name": "grpo", "groupSize": 4, "lr": 3e-3},
    "rollout": {"engine": "torch", "gpus": 0},
    "trainer": {"zeroStage": 1, "gpus": 0, "microBatchSize": 64},
}


def tiny_job(
    name: str,
    policies: list[str],
    workflow: dict[str, Any],
    *,
    steps: int,
    episodes: int,
    seed: int,
    mode: str = "async",
    staleness: int = 1,
) -> RLJob:
    """The RLJob of `policies`, each the built-in tiny model, objectstore sync, no checkpoints."""
    return RLJob.model_validate(
        {
            "apiVersion": "polyrl.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": name},
            "spec": {
                "mode": mode,
                "maxStaleness": staleness,
                "training": {"totalSteps": steps, "episodesPerStep": episodes, "seed": seed},
                "workflow": workflow,
                "policies": [{"name": n, **TINY_POLICY} for n in policies],
                "weightSync": {"transport": "objectstore"},
                "checkpoint": {"everySteps": 10_000},
            },
        }
    )


def start_ray() -> None:
    """A private local Ray (never another process's cluster) with every core of this machine."""
    set_env_defaults()
    ray.init(
        address="local",
        num_cpus=os.cpu_count() or 2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
    )


def split_cpus() -> dict[str, frozenset[int]]:
    """Each role on its own cores, as pods have them: rollout engines and workflow workers on the first
    half of this process's CPUs, trainers on the rest (on 2 cores: `rollout=0 workflow=0 trainer=1`)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("splitting cores between roles needs at least 2 CPUs")
    gen, train = frozenset(cpus[: len(cpus) // 2]), frozenset(cpus[len(cpus) // 2 :])
    return {"rollout": gen, "workflow": gen, "trainer": train}


def run_job(
    job: RLJob,
    on_record: Callable[[Any], None] | None = None,
    *,
    cpu_sets: dict[str, frozenset[int]] | None = None,
    checkpoint_root: Path | None = None,
) -> RunSummary:
    """Train `job` in this process (actors placed without pod resources) in a scratch folder;
    `cpu_sets` pins each role's actors (`polyrl run --cpus`), None shares every core;
    `checkpoint_root` keeps the checkpoints and exports (`export/step-N/<policy>/`) there."""
    with tempfile.TemporaryDirectory() as tmp:
        opts = DriverOptions(
            out_dir=Path(tmp),
            checkpoint_root=checkpoint_root or Path(tmp) / "ckpt",
            place_by_resource=False,
            on_record=on_record,
            cpu_sets=dict(cpu_sets or {}),
        )
        return asyncio.run(Driver(job, opts).run())  # it stops its actors as it returns


def stop_ray() -> None:
    ray.shutdown()
