"""Sleep and wake of the torch engine (`Engine.sleep`, for device pools), a mixin of `TorchEngine`.

`sleep` stops admitting requests that arrive after it (they wait in `_held`), lets the accepted
ones finish (a past version's on its serving copies too, which are then dropped: `engines/
full_snapshots.py`), frees the KV cache and parks the weights (`polyrl_runtime.device_memory`: level 1
copies them to host memory on a GPU and leaves them on a CPU engine, whose device is the host;
level 2 drops them and resets the version to -1, so the next update loads them whatever its
version). `wake_up` brings them back; the held requests are then served, after level 2 once an
update has loaded weights. Sleep, wake and weight updates exclude each other (`_control`).
"""

from __future__ import annotations

import asyncio
import time

import structlog
import torch

from polyrl_runtime.device_memory import HostBuffers, ParkedMemory, park_module
from polyrl_runtime.engines.api import EngineAsleepError, SleepReport, WakeReport, check_sleep_level
from polyrl_runtime.engines.full_snapshots import FullSnapshots
from polyrl_runtime.engines.hf_cache import BatchCache
from polyrl_runtime.engines.torch_request import TorchRequest
from polyrl_runtime.models.tiny import KVCache, TinyCausalLM
from polyrl_runtime.weights.api import TensorTarget, WeightTarget

log = structlog.get_logger(__name__)


class TorchEngineSleep:
    """`sleep` / `wake_up` over the engine's state, which `TorchEngine.__init__` sets."""

    name: str
    device: torch.device
    model: torch.nn.Module
    target: TensorTarget
    adapters: object | None  # `engines.adapters.EngineAdapters` when it serves LoRA adapters
    _weight_target: WeightTarget
    _cache: KVCache | None
    _kv: BatchCache
    _kv_rows: list[TorchRequest]
    _pending: list[TorchRequest]
    _active: list[TorchRequest]
    _paused: bool
    # The level asleep at (0: awake), whether `sleep` is waiting for accepted requests, the parked
    # weights, requests that arrived since `sleep` began, and whether they wait for a weight update.
    _asleep: int
    _draining: bool
    _parked: ParkedMemory | None
    _host_buffers: HostBuffers
    _held: list[TorchRequest]
    _needs_weights: bool
    _control_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None
    full_snapshots: FullSnapshots | None  # its serving copies are dropped while it sleeps

    def _ensure_loop(self) -> asyncio.Event:
        raise NotImplementedError  # the engine's serving loop

    def _control(self) -> asyncio.Lock:
        """The lock that serialises sleep, wake and weight updates (one per event loop)."""
        loop = asyncio.get_running_loop()
        if self._control_lock is None or self._control_lock[0] is not loop:
            self._control_lock = (loop, asyncio.Lock())
        return self._control_lock[1]

    async def sleep(self, level: int = 1) -> SleepReport:
        check_sleep_level(self.name, level)
        if level == 2 and self.adapters is not None:
            # Its trainers publish adapters only: nothing would ever bring the dropped base back.
            raise ValueError(
                f"engine {self.name} serves LoRA adapters on a base no update resends: it sleeps at level 1 only"
            )
        async with self._control():
            if self._asleep:
                raise EngineAsleepError(self.name, self._asleep, "sleeping again")
            start = time.perf_counter()
            self._draining = True
            full = self.full_snapshots
            try:
                freed = await full.pause() if full is not None else 0
                await self._finish_accepted()
            except BaseException:
                self._draining = False
                self._release_held()
                if full is not None:
                    await full.resume()
                raise
            freed += self._free_kv_cache()
            on_device = self.device.type != "cpu"  # on a CPU engine the weights are in host memory
            if level == 1 and not on_device:
                self._parked = ParkedMemory()
            else:
                self._parked = await asyncio.to_thread(
                    park_module,
                    self.model,
                    keep_parameters=level == 1,
                    device=self.device if on_device else None,
                    buffers=self._host_buffers,
                )
            if level == 2:  # no weights: the next update loads them, whatever its version
                self.target = TensorTarget.from_module(self.model)
                self._weight_target = self.target
            self._asleep, self._draining = level, False
            report = SleepReport(self.name, level, time.perf_counter() - start, freed + self._parked.nbytes)
        log.info(
            "engine.asleep",
            engine=self.name,
            level=level,
            freed_bytes=report.freed_bytes,
            seconds=report.seconds,
        )
        return report

    async def _finish_accepted(self) -> None:
        """Wait until every request accepted before `sleep` has finished (polled: a rare call)."""
        while self._pending or self._active:
            if self._paused:
                n = len(self._pending) + len(self._active)
                raise RuntimeError(
                    f"engine {self.name} is paused with {n} requests in flight: resume() it before "
                    "sleep (sleep lets them finish)"
                )
            self._ensure_loop().set()
            await asyncio.sleep(0.002)

    def _free_kv_cache(self) -> int:
        """Drop the KV cache (no request is running); the bytes it held."""
        freed = self._kv.nbytes
        self._kv, self._kv_rows = BatchCache.empty(self.device), []
        if self._cache is not None and isinstance(self.model, TinyCausalLM):
            freed += sum(t.nbytes for t in (*self._cache.k, *self._cache.v, self._cache.lengths))
            self._cache = self.model.new_cache(0)  # grows again with the batch
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    async def wake_up(self) -> WakeReport:
        async with self._control():
            if not self._asleep or self._parked is None:
                raise RuntimeError(f"engine {self.name} is awake: nothing to wake")
            start = time.perf_counter()
            await asyncio.to_thread(self._parked.restore, f"engine {self.name}")
            level, restored = self._asleep, self._parked.nbytes
            self._parked, self._asleep = None, 0
            self._needs_weights = level == 2
            if not self._needs_weights:
                self._release_held()
            if self.full_snapshots is not None:  # snapshots are host copies: they need no update
                await self.full_snapshots.resume()
            report = WakeReport(self.name, level, time.perf_counter() - start, restored, self._needs_weights)
        log.info(
            "engine.awake", engine=self.name, level=level, restored_bytes=restored, seconds=report.seconds
        )
        return report

    def _release_held(self) -> None:
        """Requests that waited for the engine join the queue."""
        if self._held:
            self._pending.extend(self._held)
            self._held.clear()
            self._ensure_loop().set()
