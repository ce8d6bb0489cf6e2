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
from polyrl_runtime.actors import actor_gone
from polyrl_runtime.coordinator.checkpoints.store import TRAINER_TAG, CheckpointRef, CheckpointStore
from polyrl_runtime.coordinator.job_state import JobControl, PolicyRun
from polyrl_runtime.coordinator.pool_scheduler import DevicePools
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.trainers.export import export_due, export_location

log = structlog.get_logger(__name__)


class TrainerLostError(RuntimeError):
    """A policy's trainer rank died while a checkpoint was cut: that checkpoint is abandoned."""

    def __init__(self, policy: str, error: BaseException) -> None:
        super().__init__(f"policy {policy}: a trainer rank died while saving: {error}")
        self.policy = policy


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
        self._restart_points: dict[str, CheckpointRef] = {}  # per policy, its newest (this attempt's)
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
        stored, so a resumed series has no gap). Restart points of earlier attempts go."""
        self._buffer, self._counters, self._flush_metrics = buffer, counters, flush_metrics
        self.store.drop_restart_points()

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

    def latest_with(self, policy: str) -> CheckpointRef | None:
        """Where a restart of `policy`'s trainer alone loads from: the newer of its entry in the
        latest complete checkpoint and its own latest restart point (`maybe_restart_point`); None
        when there is neither (or the policy joined the job since)."""
        ref = (
            self.last_ckpt
            if self.last_ckpt is not None and policy in self.last_ckpt.state["policies"]
            else None
        )
        own = self._restart_points.get(policy)
        if own is not None and (ref is None or own.step > int(ref.state["policies"][policy]["step"])):
            return own
        return ref

    async def maybe_restart_point(self, run: PolicyRun) -> None:
        """Save `run`'s trainer state alone (its lock held, after a step, for a trainer that can
        restart alone: coordinator/policy_restart.py) once it is `checkpoint.everySteps` of its own
        steps past the state a restart would load. A job checkpoint is cut at the slowest training
        policy's pace, so a faster policy would otherwise restart from many of its own steps back.
        Not for the slowest policy (unless another is restarting, which holds job checkpoints
        back), a job of one policy, nor the last step (the final checkpoint follows). A job restart
        resumes from the job's checkpoints only: they hold the experience buffer and the counters
        that match."""
        if len(self.runs) < 2 or run.step >= self.total:
            return
        others = [r for r in self.runs.values() if r is not run]
        restarting = any(r.trainer_state == "restarting" for r in others)  # no job checkpoint meanwhile
        slowest = all(run.step <= r.step for r in others if r.trainer_state == "training")
        if slowest and not restarting:
            return  # the job's next checkpoint comes at this policy's pace
        at = self.latest_with(run.name)
        since = int(at.state["policies"][run.name]["step"]) if at is not None else 0
        if run.step < since + self.job.spec.checkpoint.every_steps:
            return
        location = self.store.begin(run.step, policy=run.name)
        d = storage.join(location, "trainers", run.name)
        try:
            async with self.pools.resident(run.name):
                await asyncio.gather(*(r.save(d, TRAINER_TAG) for r in run.ranks))
        except BaseException:  # a lost rank: the caller fails the step
            self.store.abandon(location)
            raise
        state = {
            "step": run.step,
            "reason": "restart point",
            "policies": {run.name: run.checkpoint_state()},
            "job": self.job.metadata.name,
        }
        ref = await asyncio.to_thread(self.store.commit, location, state, None)
        self._restart_points[run.name] = ref
        log.info("checkpoint.restart_point", policy=run.name, step=run.step, location=ref.location)

    def _carried(self, name: str) -> dict[str, Any] | None:
        """The entry of a policy whose trainer is not up (restarting or frozen): its entry of the
        latest checkpoint that holds its trainer state, naming that one (`trainer_at`); a resume
        restarts it from there. None when no checkpoint holds it (a resume starts it afresh)."""
        ref = self.latest_with(name)
        if ref is None:
            return None
        entry = dict(ref.state["policies"][name])
        return {**entry, "trainer_at": entry.get("trainer_at") or ref.name}

    def _steps(self) -> dict[str, int]:
        """Each trained policy's step (a frozen one, `trainer: null`, has none to checkpoint)."""
        return {n: r.step for n, r in self.runs.items() if not r.served_only}

    async def maybe_checkpoint(self) -> None:
        training = [r for r in self.runs.values() if r.trainer_state != "frozen"]
        if not training or any(r.trainer_state == "restarting" for r in training):
            return  # a restarting trainer holds nothing to save yet: the next step's turn takes it
        every = self.job.spec.checkpoint.every_steps
        low = min(r.step for r in training)
        last = self.last_ckpt.step if self.last_ckpt is not None else 0
        if low >= last + every and low < self.total:
            try:
                await self.checkpoint("periodic")
            except TrainerLostError as e:  # that policy's next step fails and restarts its trainer
                log.warning("checkpoint.abandoned", policy=e.policy, error=str(e))

    async def checkpoint(self, reason: str, request_id: str | None = None) -> CheckpointRef | None:
        buffer = self._buffer
        if buffer is None:  # starting: no trainer holds weights yet (a request is answered later)
            log.info("checkpoint.before_start", reason=reason, request_id=request_id)
            return self.last_ckpt
        async with self._lock:
            if request_id is not None and request_id in self.handled_requests:
                return self.last_ckpt
            steps = self._steps()
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
        steps = self._steps()
        tmp = self.store.begin(min(steps.values()))
        try:
            return await self._write_cut(tmp, steps, reason, request_id, buffer)
        except BaseException:
            self.store.abandon(tmp)  # never committed: the previous checkpoint stays the latest
            raise

    async def _write_cut(
        self, tmp: str, steps: dict[str, int], reason: str, request_id: str | None, buffer: BufferClient
    ) -> CheckpointRef:
        down = {n for n, r in self.runs.items() if r.trainer_state in ("restarting", "frozen")}
        for n, run in self.runs.items():
            if n in down:  # no ranks to save: its entry names where its trainer state is
                continue
            d = storage.join(tmp, "trainers", n)  # each rank uploads its part there
            async with self.pools.resident(n):
                try:
                    await asyncio.gather(*(r.save(d, TRAINER_TAG) for r in run.ranks))
                except Exception as e:
                    if actor_gone(e):
                        raise TrainerLostError(n, e) from e
                    raise
        # The counters before the snapshot: the data position must not run ahead of it (datafeed.py).
        counters = self._counters()
        snap = await buffer.snapshot()
        if request_id is not None:
            self.handled_requests.append(request_id)
        state = {
            "step": min(steps.values()),
            "reason": reason,
            "policies": {
                n: entry
                for n, entry in (
                    (n, self._carried(n) if n in down else r.checkpoint_state()) for n, r in self.runs.items()
                )
                if entry is not None
            },
            **counters,
            "elapsed_s": self.control.elapsed(),
            "request_ids": self.handled_requests[-100:],
            "job": self.job.metadata.name,
        }
        await asyncio.to_thread(self._flush_metrics)
        self.last_ckpt = await asyncio.to_thread(self.store.commit, tmp, state, snap)
        for r in self.runs.values():
            r.last_ckpt_step = r.step
        log.info("checkpoint.committed", location=self.last_ckpt.location, reason=reason, steps=steps)
        self.control.emit("checkpoint", path=self.last_ckpt.location, reason=reason, steps=steps)
        return self.last_ckpt
