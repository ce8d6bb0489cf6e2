"""Checkpoints and Hugging Face exports: every `checkpoint.everySteps` steps, on request, at the end.

Each checkpoint is a consistent cut: every policy's trainer lock is held while the trainers save, the
experience buffer's snapshot and the job's counters (`counters()`: the producer's, and whatever else
the driver keeps) are taken under the same locks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

from polyrl_operator.api import RLJob
from polyrl_runtime import storage
from polyrl_runtime.coordinator.checkpoints.store import TRAINER_TAG, CheckpointRef, CheckpointStore
from polyrl_runtime.coordinator.job_state import JobControl, PolicyRun
from polyrl_runtime.coordinator.pool_scheduler import DevicePools
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.trainers.export import export_due, export_location

log = structlog.get_logger(__name__)


class Checkpointer:
    """Takes checkpoints of `runs` into `store` and answers checkpoint requests once each."""

    def __init__(
        self,
        job: RLJob,
        store: CheckpointStore,
        control: JobControl,
        runs: dict[str, PolicyRun],
        requests: Callable[[], str | None] | None,
        *,
        pools: DevicePools,
    ) -> None:
        self.job, self.store, self.control, self.runs = job, store, control, runs
        self.pools = pools  # a pooled trainer saves and exports on its devices, in a turn
        self._requests = requests
        self.total = job.spec.training.total_steps
        self.last_ckpt: CheckpointRef | None = None
        self.handled_requests: list[str] = []
        self.in_progress = False
        self._lock = asyncio.Lock()
        self._buffer: BufferClient | None = None  # None until the job has started (`attach`)
        self._counters: Callable[[], dict[str, Any]] = dict
        self._flush_metrics: Callable[[], None] = lambda: None

    def attach(
        self, buffer: BufferClient, counters: Callable[[], dict[str, Any]], flush_metrics: Callable[[], None]
    ) -> None:
        """The experience buffer and the counters a checkpoint records, once the job has them, and
        the metrics flush that runs before each commit (every step a checkpoint holds has its row
        stored, so a resumed series has no gap)."""
        self._buffer, self._counters, self._flush_metrics = buffer, counters, flush_metrics

    def resumed(self, ref: CheckpointRef) -> None:
        self.last_ckpt = ref
        self.handled_requests = list(ref.state.get("request_ids", []))
        for run in self.runs.values():
            run.last_ckpt_step = run.step

    def pending_request(self) -> str | None:
        """The checkpoint request not answered yet (the pod's annotation), if any."""
        request = self._requests() if self._requests is not None else None
        return request if request and request not in self.handled_requests else None

    async def maybe_export(self, run: PolicyRun) -> None:
        """Export the policy as a Hugging Face directory every `checkpoint.exportEvery` steps and at
        its last step (trainers/export.py); every rank takes part (ZeRO-3 gathers are collective)."""
        if not export_due(run.step, self.total, self.job.spec.checkpoint.export_every):
            return
        location = export_location(self.store.root, run.step, run.name)
        async with self.pools.resident(run.name):
            await asyncio.gather(*(r.export(location) for r in run.ranks))
        self.control.emit("export", policy=run.name, step=run.step, path=location)

    async def maybe_checkpoint(self) -> None:
        every = self.job.spec.checkpoint.every_steps
        low = min(r.step for r in self.runs.values())
        last = self.last_ckpt.step if self.last_ckpt is not None else 0
        if low >= last + every and low < self.total:
            await self.checkpoint("periodic")

    async def checkpoint(self, reason: str, request_id: str | None = None) -> CheckpointRef | None:
        buffer = self._buffer
        if buffer is None:  # starting: no trainer holds weights yet (a request is answered later)
            log.info("checkpoint.before_start", reason=reason, request_id=request_id)
            return self.last_ckpt
        async with self._lock:
            if request_id is not None and request_id in self.handled_requests:
                return self.last_ckpt
            steps = {n: r.step for n, r in self.runs.items()}
            if self.last_ckpt is not None and steps == {
                n: int(v["step"]) for n, v in self.last_ckpt.state["policies"].items()
            }:
                if request_id is not None:
                    self.handled_requests.append(request_id)
                return self.last_ckpt  # nothing new since the last one
            self.in_progress = True
            locks = [self.runs[n].lock for n in sorted(self.runs)]
            for lock in locks:
                await lock.acquire()
            try:
                return await self._cut(reason, request_id, buffer)
            finally:
                for lock in locks:
                    lock.release()
                self.in_progress = False

    async def _cut(self, reason: str, request_id: str | None, buffer: BufferClient) -> CheckpointRef:
        steps = {n: r.step for n, r in self.runs.items()}
        tmp = self.store.begin(min(steps.values()))
        for n, run in self.runs.items():
            d = storage.join(tmp, "trainers", n)  # each rank uploads its part there
            async with self.pools.resident(n):
                await asyncio.gather(*(r.save(d, TRAINER_TAG) for r in run.ranks))
        # The counters before the snapshot: the data position must not run ahead of it (datafeed.py).
        counters = self._counters()
        snap = await buffer.snapshot()
        if request_id is not None:
            self.handled_requests.append(request_id)
        state = {
            "step": min(steps.values()),
            "reason": reason,
            "policies": {n: r.checkpoint_state() for n, r in self.runs.items()},
            **counters,
            "elapsed_s": self.control.elapsed(),
            "request_ids": self.handled_requests[-100:],
            "job": self.job.metadata.name,
        }
        await asyncio.to_thread(self._flush_metrics)
        self.last_ckpt = await asyncio.to_thread(self.store.commit, tmp, state, snap)
        for r in self.runs.values():
            r.last_ckpt_step = r.step
        self.control.emit("checkpoint", path=self.last_ckpt.location, reason=reason, steps=steps)
        return self.last_ckpt
