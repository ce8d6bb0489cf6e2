"""The `/progress` document's pools (coordinator/report.py): each scheduled pool's usage as the
operator reads it (busy fraction as of the snapshot, switches, switch seconds, resident seconds and
training turns per policy), only pools that host a trainer listed, and the wire form parsing back."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from driver_harness import BASE, new_driver, policy

from polyrl_operator.api import RLJob
from polyrl_operator.api.progress import PoolProgress, Progress
from polyrl_runtime.coordinator.pool_scheduler import PoolUsage, device_pools
from polyrl_runtime.coordinator.report import JobSnapshot, pool_snapshots, progress_report


def _snapshot(**fields: Any) -> JobSnapshot:
    base: dict[str, Any] = {
        "state": "running",
        "message": "",
        "retryable": True,
        "attempt": None,
        "policies": [],
        "workers": [],
        "last_ckpt_step": None,
        "last_ckpt_location": None,
        "last_request_id": None,
        "ckpt_in_progress": False,
        "episodes": 0,
        "failed": {},
        "elapsed_s": 1.0,
    }
    return JobSnapshot(**(base | fields))


USED = PoolUsage(started=10.0, switches=4, switch_s=0.5, turns={"a": 2}, trainer_s={"a": 3.0}, busy_s=5.0)


@pytest.mark.parametrize(
    ("usage", "now", "expected"),
    [
        ({}, 20.0, []),  # no pool hosts a trainer
        (
            {"t": USED},
            20.0,
            [
                {
                    "name": "t",
                    "busyFraction": 0.5,
                    "switches": 4,
                    "switchSeconds": 0.5,
                    "residentSeconds": {"a": 3.0},
                    "turns": {"a": 2},
                }
            ],
        ),
        ({"t": PoolUsage(started=10.0, busy_s=12.0)}, 20.0, [{"busyFraction": 1.0}]),  # sampled late
        ({"t": PoolUsage(started=10.0)}, 10.0, [{"busyFraction": 0.0, "switches": 0, "turns": {}}]),
    ],
    ids=["no-pools", "used", "busy-capped-at-one", "just-started"],
)
def test_progress_reports_each_scheduled_pool(
    usage: dict[str, PoolUsage], now: float, expected: list[dict[str, Any]]
) -> None:
    doc = progress_report(_snapshot(pools=pool_snapshots(usage, now)))
    pools = [q.to_wire() for q in doc.pools]
    assert [{k: got[k] for k in want} for got, want in zip(pools, expected, strict=True)] == expected
    assert Progress.model_validate(doc.to_wire()) == doc


def test_the_snapshot_copies_the_usage() -> None:
    usage = PoolUsage(started=0.0, turns={"a": 1}, trainer_s={"a": 1.0})
    [snap] = pool_snapshots({"t": usage}, 1.0)
    usage.turns["a"] += 1
    usage.trainer_s["b"] = 2.0
    assert (snap.turns, snap.resident_s) == ({"a": 1}, {"a": 1.0})


def _job() -> RLJob:
    """BASE with policies a and b: both trainers and a's rollout on CPU pool t, b's rollout on pool
    g (engines only: never scheduled)."""
    pols = [policy(n) for n in "ab"]
    for p, role, pool in (
        ("a", "trainer", "t"),
        ("b", "trainer", "t"),
        ("a", "rollout", "t"),
        ("b", "rollout", "g"),
    ):
        settings = next(q for q in pols if q["name"] == p)[role]
        for key in ("replicas", "gpus", "gpuType"):
            settings.pop(key, None)
        settings["pool"] = pool
    pools = [{"name": "t", "gpus": 1}, {"name": "g", "gpus": 1}]
    return RLJob.model_validate({**BASE, "spec": {**BASE["spec"], "policies": pols, "pools": pools}})


class _Role:
    """An engine or a trainer rank that switches at once."""

    async def _done(self) -> None:
        await asyncio.sleep(0)

    def sleep(self, level: int = 1) -> Any:
        return self._done()

    def wake_up(self) -> Any:
        return self._done()

    def offload(self) -> Any:
        return self._done()

    def restore(self) -> Any:
        return self._done()


async def test_turns_show_in_progress_and_an_engine_only_pool_is_not_listed() -> None:
    roles = {p: [_Role()] for p in "ab"}
    pools = device_pools(_job().spec, roles.__getitem__, roles.__getitem__)
    await pools.park_trainers()
    for p in "aba":
        async with pools.training(p):
            pass
    async with pools.resident("b"):  # a checkpoint: held, not a training turn
        pass
    doc = progress_report(_snapshot(pools=pool_snapshots(pools.usage(), time.monotonic())))
    [shared] = doc.pools
    assert (shared.name, shared.switches, shared.turns) == ("t", 8, {"a": 2, "b": 1})
    assert set(shared.resident_seconds) == {"a", "b"} and shared.switch_seconds >= 0.0
    assert Progress.model_validate(doc.to_wire()) == doc


def test_the_driver_reports_its_scheduled_pools_before_it_runs(tmp_path: Path) -> None:
    """A driver not yet started (no actor, no Ray) already lists its trainer's pool, unused."""
    pools = new_driver(_job(), tmp_path).progress().pools
    assert pools == [PoolProgress(name="t")]
