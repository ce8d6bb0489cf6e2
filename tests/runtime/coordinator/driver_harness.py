"""Helpers for the driver tests: jobs derived from tests/runtime/data/selfplay-tiny.yaml."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator.api import RLJob
from polyrl_runtime.coordinator import driver as driver_module
from polyrl_runtime.coordinator.driver import Driver, DriverOptions
from polyrl_runtime.coordinator.pool_scheduler import DevicePools, PoolScheduler, pool_roles
from polyrl_runtime.coordinator.report import RunSummary

DATA = Path(__file__).parent.parent / "data"
BASE = yaml.safe_load((DATA / "selfplay-tiny.yaml").read_text())


def make_job(**spec: Any) -> RLJob:
    doc = copy.deepcopy(BASE)
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key].update(value)
        else:
            doc["spec"][key] = value
    return RLJob.model_validate(doc)


def policy(name: str = "agent", **fields: Any) -> dict[str, Any]:
    p = copy.deepcopy(BASE["spec"]["policies"][0])
    p["name"] = name
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(p.get(key), dict):
            p[key].update(value)
        else:
            p[key] = value
    return p


def new_driver(job: RLJob, tmp: Path, **opts: Any) -> Driver:
    options = DriverOptions(
        out_dir=tmp, checkpoint_root=tmp / "ckpt", place_by_resource=False, poll_s=0.2, **opts
    )
    return Driver(job, options)


def run(job: RLJob, tmp: Path, **opts: Any) -> tuple[Driver, RunSummary]:
    d = new_driver(job, tmp, **opts)
    return d, asyncio.run(d.run())


def still_running(task: asyncio.Task[Any], what: str) -> None:
    """Fail the test at once when the driver ended before `what` (a loop that only polled for `what`
    would wait forever on a job that failed early)."""
    if task.done():
        summary = task.result()
        raise AssertionError(f"the driver ended ({summary.state}: {summary.message}) before {what}")


async def until(task: asyncio.Task[Any], ready: Callable[[], bool], what: str) -> None:
    """Wait for `ready` while the driver runs."""
    while not ready():
        still_running(task, what)
        await asyncio.sleep(0.05)


def cpu_pools_take_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drivers built from here on schedule every pool that hosts a trainer as a GPU pool is (engines
    asleep, trainers offloaded between turns), CPU pools included: the GPU pools' switching through
    the actors' real Ray calls, on a machine without GPUs."""

    def every_pool(spec: Any, engines: Any, ranks: Any) -> DevicePools:
        return DevicePools(
            {r.pool: PoolScheduler(r, engines, ranks) for r in pool_roles(spec) if r.scheduled}, spec
        )

    monkeypatch.setattr(driver_module, "device_pools", every_pool)
