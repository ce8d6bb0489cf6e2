"""The work queue's invariants: kicks coalesce, one run per key at a time, a kick during a run makes
exactly one more run, a delayed kick keeps the earliest timer."""

from __future__ import annotations

import asyncio

from polyrl_operator.reconciling.queue import Key, WorkQueue

A: Key = ("team-a", "a")
B: Key = ("team-a", "b")


class Recorder:
    def __init__(self) -> None:
        self.runs: list[Key] = []
        self.active: set[Key] = set()
        self.overlap = False
        self.gate = asyncio.Event()
        self.gate.set()

    async def work(self, key: Key) -> None:
        self.overlap |= key in self.active
        self.active.add(key)
        self.runs.append(key)
        await self.gate.wait()
        self.active.discard(key)


async def test_kicks_during_a_run_make_exactly_one_more_run() -> None:
    rec = Recorder()
    queue = WorkQueue(rec.work, concurrency=4)
    rec.gate.clear()
    queue.kick(A)
    await asyncio.sleep(0)
    for _ in range(5):
        queue.kick(A)
    rec.gate.set()
    await queue.idle()
    assert rec.runs == [A, A] and not rec.overlap


async def test_keys_run_side_by_side_within_the_concurrency() -> None:
    rec = Recorder()
    queue = WorkQueue(rec.work, concurrency=1)
    rec.gate.clear()
    queue.kick(A)
    queue.kick(B)
    await asyncio.sleep(0.01)
    assert rec.runs == [A]  # B waits for the one slot
    rec.gate.set()
    await queue.idle()
    assert sorted(rec.runs) == [A, B]


async def test_a_delayed_kick_keeps_the_earliest_timer() -> None:
    rec = Recorder()
    queue = WorkQueue(rec.work, concurrency=4)
    queue.kick(A, 0.05)
    queue.kick(A, 10)  # later: ignored
    queue.kick(A, 0.02)  # earlier: replaces
    await asyncio.sleep(0.1)
    await queue.idle()
    assert rec.runs == [A]
    queue.kick(A, 0.02)
    queue.forget(A)
    await asyncio.sleep(0.05)
    assert rec.runs == [A]
    await queue.close()
