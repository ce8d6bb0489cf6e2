"""The work queue: every trigger is a kick of a job's key, and kicks coalesce.

Invariants:

* a key has at most one run at a time;
* a kick while its key runs makes exactly one more run after the current one, however many kicks
  came meanwhile (no lost trigger, no pile-up);
* a delayed kick keeps only the earliest pending timer of its key;
* at most ``concurrency`` runs proceed at once, across keys.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Key = tuple[str, str]
"""(namespace, name) of an RLJob."""


class WorkQueue:
    def __init__(self, work: Callable[[Key], Awaitable[None]], *, concurrency: int) -> None:
        self._work = work
        self._limit = asyncio.Semaphore(concurrency)
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._dirty: set[Key] = set()
        self._timers: dict[Key, tuple[float, asyncio.TimerHandle]] = {}

    def kick(self, key: Key, delay: float = 0.0) -> None:
        """Run ``key`` now (or after ``delay`` seconds)."""
        loop = asyncio.get_running_loop()
        if delay > 0:
            due = loop.time() + delay
            current = self._timers.get(key)
            if current is not None and current[0] <= due:
                return
            if current is not None:
                current[1].cancel()
            self._timers[key] = (due, loop.call_at(due, self._fire, key))
            return
        if key in self._running:
            self._dirty.add(key)
            return
        self._running[key] = asyncio.create_task(self._worker(key), name=f"reconcile {key[0]}/{key[1]}")

    def forget(self, key: Key) -> None:
        """Drop the pending timer of ``key`` (a run in progress finishes)."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()

    def _fire(self, key: Key) -> None:
        self._timers.pop(key, None)
        self.kick(key)

    async def _worker(self, key: Key) -> None:
        try:
            while True:
                self._dirty.discard(key)
                async with self._limit:
                    await self._work(key)
                if key not in self._dirty:
                    break
        finally:
            self._running.pop(key, None)

    async def idle(self) -> None:
        """Wait until no run is in progress (tests and the benchmark use it)."""
        while self._running:
            await asyncio.gather(*list(self._running.values()), return_exceptions=True)

    async def close(self) -> None:
        """Cancel every timer and every run in progress."""
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*list(self._running.values()), return_exceptions=True)
