"""Past versions of a full-weight policy in the torch engine (a league's opponents without LoRA).

A past version of full weights is a whole second model, so the engine keeps two tiers:

- **Host memory**: each snapshot's tensors, copied from the served weights between two forward
  passes (`take`), at most `keep` (the oldest evicted, as an engine of adapters evicts). This is the
  snapshot's lasting cost: one copy of the model's weights in host memory per snapshot.
- **Serving copies** (`slots`, `league.residentSnapshots`): copies of the model on the engine's
  device, each loaded with one snapshot and run as an engine of its own (its own batches and KV
  cache: one forward pass cannot mix two sets of full weights). A request for a snapshot that no copy
  holds takes the least recently used idle copy, whose weights are then loaded from host memory (the
  switch, timed), or a new copy while fewer than `slots` exist; when every copy is busy it waits for
  one to go idle (logged once per request). A copy therefore switches only between its batches.

On a CPU engine the host is the device: a copy serves the host tensors themselves (swapped in, no
second copy), so a switch costs no copy. On a GPU the copy's parameters are on the device and a switch
copies the snapshot into them.

A snapshot evicted from host memory is refused to requests from then on (`UnknownSnapshotError`, also
for requests still waiting for a copy); requests already running on a copy that holds it finish
there, as the copy's weights stay until it switches. While the engine sleeps (`pause`) no copy
serves: requests wait, the copies are dropped (their device memory freed), and the host copies stay.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog
import torch

from polyrl_runtime.engines.api import Generation, SamplingParams, SnapshotReport, UnknownSnapshotError
from polyrl_runtime.weights.api import TensorTarget

log = structlog.get_logger(__name__)


class SlotEngine(Protocol):
    """What a serving copy is: a torch engine over a copy of the model (`TorchEngine`)."""

    target: TensorTarget

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    async def abort(self, request_ids: list[str]) -> None: ...

    def serves(self, request_id: str) -> bool: ...

    def load(self) -> tuple[int, int]: ...


@dataclass(eq=False)
class Slot:
    """One serving copy: the snapshot it holds (None: none yet), its requests, when it was last used."""

    engine: SlotEngine
    version: int | None = None
    in_flight: int = 0
    used: int = 0
    ready: asyncio.Future[None] | None = None  # set while its weights are being loaded


def _nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


class FullSnapshots:
    """One full-weight engine's snapshots of its policy: host copies and serving copies."""

    def __init__(self, engine: str, policy: str, slots: int, new_slot: Callable[[int], SlotEngine]) -> None:
        if slots < 1:
            raise ValueError(f"engine {engine}: residentSnapshots must be at least 1, got {slots}")
        self.engine, self.policy, self.max_slots = engine, policy, slots
        self._new_slot = new_slot
        self.host: dict[int, dict[str, torch.Tensor]] = {}  # version -> its tensors in host memory
        self.slots: list[Slot] = []
        self._clock = 0
        self._paused = False
        self._cond: tuple[asyncio.AbstractEventLoop, asyncio.Condition] | None = None
        self.switches = 0
        self.switch_s = 0.0
        self._tasks: set[asyncio.Task[None]] = set()  # held until done (the loop keeps weak references)

    # -- holding -------------------------------------------------------------------------------

    @staticmethod
    def copy_of(target: TensorTarget) -> tuple[int, dict[str, torch.Tensor]]:
        """`target`'s version and a host copy of its tensors, taken between two forward passes (off
        the event loop: it takes the serving lock for the copy)."""
        with target.lock:
            tensors = {
                n: t.detach().to("cpu", copy=True).contiguous() for n, t in target.named_tensors().items()
            }
            return target.version, tensors

    def hold(self, version: int, tensors: Mapping[str, torch.Tensor], keep: int) -> SnapshotReport:
        """Hold `tensors` as the snapshot of `version` (held already: nothing to do), the oldest
        beyond `keep` evicted."""
        self._check_keep(keep)
        evicted: list[int] = []
        if version not in self.host:
            evicted = self._make_room(keep)
            self.host[version] = {n: t.to("cpu").contiguous() for n, t in tensors.items()}
        return self.report(version, evicted)

    def tensors(self, versions: Sequence[int]) -> dict[int, dict[str, torch.Tensor]]:
        """The host copies at `versions` (`UnknownSnapshotError` for one not held), for another engine
        of the policy to hold (`receive`)."""
        return {v: dict(self._held(v)) for v in versions}

    def receive(self, states: Mapping[int, Mapping[str, torch.Tensor]], keep: int) -> SnapshotReport:
        """Hold the snapshots `states` (from `tensors` of another engine) beside those held, at most
        `keep` of all: the newest `keep` of `states` are taken, the oldest held evicted for them, and
        one older than every snapshot kept is not taken."""
        self._check_keep(keep)
        evicted: list[int] = []
        for version in sorted(states)[-keep:]:
            if version in self.host or (len(self.host) >= keep and version < min(self.host)):
                continue
            evicted += self.hold(version, states[version], keep).evicted
        return self.report(max(self.host, default=-1), evicted)

    def _check_keep(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"engine {self.engine}: keep must be at least 1, got {keep}")

    def _make_room(self, keep: int) -> list[int]:
        evicted = []
        while len(self.host) >= keep:
            oldest = min(self.host)
            del self.host[oldest]
            evicted.append(oldest)
        if evicted:
            self._changed()  # waiting requests for an evicted snapshot are refused
        return evicted

    def _held(self, version: int) -> dict[str, torch.Tensor]:
        held = self.host.get(version)
        if held is None:
            raise UnknownSnapshotError(self.engine, self.policy, version, sorted(self.host))
        return held

    def held(self) -> list[int]:
        return sorted(self.host)

    def host_nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.host.values())

    def serving_nbytes(self) -> int:
        """Device bytes the serving copies hold beyond the host copies (none on a CPU engine)."""
        total = 0
        for slot in self.slots:
            tensors = slot.engine.target.named_tensors()
            if any(t.device.type != "cpu" for t in tensors.values()):
                total += _nbytes(tensors)
        return total

    def report(self, version: int, evicted: Sequence[int]) -> SnapshotReport:
        return SnapshotReport(
            self.policy,
            version,
            tuple(evicted),
            tuple(self.held()),
            self.host_nbytes() + self.serving_nbytes(),
        )

    # -- serving -------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """`params.snapshot`'s reply, from a serving copy that holds it."""
        version = params.snapshot
        assert version is not None
        slot = await self._acquire(version)
        try:
            if slot.ready is not None:
                await asyncio.shield(slot.ready)
            gen = await slot.engine.generate(
                prompt_ids, dataclasses.replace(params, snapshot=None, policy="")
            )
        finally:
            slot.in_flight -= 1
            self._changed()
        return dataclasses.replace(gen, engine=self.engine)

    async def _acquire(self, version: int) -> Slot:
        """A copy that holds `version`, or is loading it, with this request counted on it."""
        cond = self._condition()
        waited = False
        async with cond:
            while True:
                self._held(version)  # refused once evicted, even after waiting
                slot = None if self._paused else self._pick(version)
                if slot is not None:
                    break
                if not waited:
                    log.info(
                        "engine.snapshot_waits",
                        engine=self.engine,
                        policy=self.policy,
                        version=version,
                        waits_for="an idle serving copy" if not self._paused else "the engine to wake",
                        serving=[s.version for s in self.slots],
                    )
                    waited = True
                await cond.wait()
            self._clock += 1
            slot.used = self._clock
            slot.in_flight += 1
            if slot.version != version:
                slot.version = version
                slot.ready = asyncio.get_running_loop().create_future()
                self._spawn(self._load(slot, version))
            return slot

    def _pick(self, version: int) -> Slot | None:
        """The copy holding `version`; else a new copy while fewer than `max_slots`; else the least
        recently used idle copy; else None (every copy busy with another snapshot)."""
        for slot in self.slots:
            if slot.version == version:
                return slot
        if len(self.slots) < self.max_slots:
            slot = Slot(self._new_slot(len(self.slots)))
            self.slots.append(slot)
            return slot
        idle = [s for s in self.slots if s.in_flight == 0 and s.ready is None]
        return min(idle, key=lambda s: s.used) if idle else None

    async def _load(self, slot: Slot, version: int) -> None:
        """Load `version`'s host copy into `slot` (off the event loop), then let its requests run."""
        assert slot.ready is not None
        start = time.perf_counter()
        try:
            await asyncio.to_thread(self._write, slot.engine.target, self._held(version), version)
        except Exception as e:  # its requests fail with the reason; the copy is loaded again next time
            log.exception(
                "engine.snapshot_load_failed", engine=self.engine, policy=self.policy, version=version
            )
            slot.version = None
            slot.ready.set_exception(e)
            slot.ready.exception()  # retrieved: its requests raise it
        else:
            slot.ready.set_result(None)
        finally:
            slot.ready = None
            self._changed()
        if slot.version != version:
            return
        seconds = time.perf_counter() - start
        self.switches += 1
        self.switch_s += seconds
        log.info(
            "engine.snapshot_loaded", engine=self.engine, policy=self.policy, version=version, seconds=seconds
        )

    @staticmethod
    def _write(target: TensorTarget, host: Mapping[str, torch.Tensor], version: int) -> None:
        with target.paused(version):
            own = target.named_tensors()
            if all(t.device.type == "cpu" for t in own.values()):
                target.swap(host)  # the host copy serves as it is
            else:
                for name, t in own.items():
                    t.copy_(host[name], non_blocking=True)
                torch.cuda.synchronize()

    async def abort(self, request_id: str) -> bool:
        """Abort `request_id` on the copy serving it; False when none does."""
        for slot in self.slots:
            if slot.engine.serves(request_id):
                await slot.engine.abort([request_id])
                return True
        return False

    # -- sleep ---------------------------------------------------------------------------------

    async def pause(self) -> int:
        """No copy serves from now on: wait for their requests, drop them; the device bytes freed."""
        cond = self._condition()
        async with cond:
            self._paused = True
            while any(s.in_flight for s in self.slots):
                await cond.wait()
            freed = self.serving_nbytes()
            self.slots.clear()
        return freed

    async def resume(self) -> None:
        cond = self._condition()
        async with cond:
            self._paused = False
            cond.notify_all()

    # -- figures -------------------------------------------------------------------------------

    def load(self) -> tuple[int, int]:
        """(in flight, queued) over the copies, and the requests waiting for one."""
        waiting = sum(s.in_flight for s in self.slots if s.ready is not None)
        counts = [s.engine.load() for s in self.slots]
        return sum(c[0] for c in counts) + waiting, sum(c[1] for c in counts) + waiting

    def figures(self) -> dict[str, float | int]:
        return {
            "snapshot_host_bytes": self.host_nbytes(),
            "snapshot_serving_bytes": self.serving_nbytes(),
            "snapshot_serving_copies": len(self.slots),
            "snapshot_switches": self.switches,
            "snapshot_switch_s": self.switch_s,
        }

    def _condition(self) -> asyncio.Condition:
        """The condition requests wait on for a copy (one per event loop)."""
        loop = asyncio.get_running_loop()
        if self._cond is None or self._cond[0] is not loop:
            self._cond = (loop, asyncio.Condition())
        return self._cond[1]

    def _changed(self) -> None:
        """Wake the requests waiting for a copy (they look again). Called on the event loop."""
        if self._cond is None or self._cond[0] is not asyncio.get_running_loop():
            return
        cond = self._cond[1]

        async def notify() -> None:
            async with cond:
                cond.notify_all()

        self._spawn(notify())

    def _spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
