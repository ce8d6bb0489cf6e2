"""Fleet supervision, every `poll_s`: answer checkpoint requests, notice dead engines and workers,
add engines and workers where the fleet has room, push the workers' routes, drain on request."""

from __future__ import annotations

import asyncio

import structlog

from polyrl_operator.api import RLJob
from polyrl_runtime.coordinator.checkpoints.checkpointer import Checkpointer
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.job_state import JobControl, PolicyRun
from polyrl_runtime.coordinator.league import Leagues
from polyrl_runtime.experience.client import BufferClient

log = structlog.get_logger(__name__)


class FleetSupervisor:
    """The periodic health, drain, elasticity and request handling of a running job."""

    def __init__(
        self,
        job: RLJob,
        *,
        fleet: Fleet,
        runs: dict[str, PolicyRun],
        buffer: BufferClient,
        control: JobControl,
        checkpointer: Checkpointer,
        leagues: Leagues,
        poll_s: float,
    ) -> None:
        self.job, self.spec, self.fleet, self.runs, self.buffer = job, job.spec, fleet, runs, buffer
        self.control, self.checkpointer, self.leagues = control, checkpointer, leagues
        self.poll_s = poll_s

    async def loop(self) -> None:
        while not self.control.stop.is_set():
            try:
                await self.once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("housekeeping.failed")
            await asyncio.sleep(self.poll_s)

    async def once(self) -> None:
        request = self.checkpointer.pending_request()
        if request is not None:
            await self.checkpointer.checkpoint("request", request)
        newly_dead = await self.fleet.poll()
        self.control.report_lost(self.fleet, newly_dead)
        await self.leagues.refresh()  # the snapshots every live engine holds, engines joined or died
        changed = bool(newly_dead)
        for run in self.runs.values():
            if run.served_only:  # a frozen policy's engines serve the model they loaded: no sync
                continue
            assert run.sync is not None
            for name in list(run.sync.engines):
                slot = self.fleet.engines[run.name].get(name)
                if slot is None or slot.dead:
                    await asyncio.to_thread(run.sync.remove_engine, name)
                    changed = True
        for p in self.spec.policies:
            # A free unit of the role's resource is a pod (or a dead engine's slot) with no engine.
            room = self.spec.rollout_placement(p).max_replicas - len(self.fleet.live_engines(p.name))
            for _ in range(max(0, min(room, self.fleet.free_units(p.name, "rollout")))):
                slot = self.fleet.new_engine(p)
                for policy in slot.shared_by or (p.name,):  # an engine of a shared base joins each sync
                    run = self.runs[policy]
                    if run.served_only:
                        continue
                    assert run.sync is not None
                    await asyncio.to_thread(run.sync.add_engine, slot.name, slot.actor)
                changed = True
                self.control.emit("engine_added", engine=slot.name, policy=p.name)
        live_workers = [w for w in self.fleet.workers.values() if not w.dead]
        free_w = self.fleet.free_units(None, "workflow")
        if free_w and len(live_workers) < self.spec.workflow.replicas.max:
            worker = self.fleet.new_worker(self.job.model_dump_json(by_alias=True), self.buffer)
            changed = True
            self.control.emit("worker_added", worker=worker.name)
        if changed:
            await self.fleet.push_routes()

    async def set_draining(self, target: str, draining: bool = True) -> bool:
        found = self.fleet.set_draining(target, draining)
        if found:
            await self.fleet.push_routes()
            self.control.emit("drain", target=target, draining=draining)
        return found
