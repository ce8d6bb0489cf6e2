"""Many requests in one engine call, answered as each finishes (the engine side of `generate_many`).

A Ray actor call costs far more CPU than a decoding step of the small models (profiled: most of a
step's CPU went to Ray handling ~190 single-request `generate` calls). So the pool sends all the
requests it has for an engine in one event-loop tick as one call, and the engine streams results
back (a Ray streaming generator) as they finish: a request never waits for the slowest of its call,
so continuous batching and long-tail behaviour are unchanged. Results that finish together travel
as one streamed item, which cuts the per-item cost too.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from polyrl_runtime.engines.api import Generation, SamplingParams

Request = tuple[list[int], SamplingParams]
# Per streamed item: (index in the call's request list, its generation or the error it raised).
Answer = tuple[int, Generation | BaseException]


async def stream_generations(
    generate: Callable[[list[int], SamplingParams], Awaitable[Generation]], requests: Sequence[Request]
) -> AsyncIterator[list[Answer]]:
    """Run `generate` for every request concurrently; yield the answers done so far, as they come.

    A request's error is answered like a result (it must fail that request only, not end the stream
    and with it the other requests of the call)."""
    done: asyncio.Queue[tuple[int, asyncio.Future[Generation]]] = asyncio.Queue()
    tasks: list[asyncio.Future[Generation]] = []
    for i, (prompt, params) in enumerate(requests):
        task = asyncio.ensure_future(generate(prompt, params))
        task.add_done_callback(functools.partial(_finished, done, i))
        tasks.append(task)
    left = len(tasks)
    try:
        while left:
            ready = [await done.get()]
            while not done.empty():  # everything that finished in the same engine step: one item
                ready.append(done.get_nowait())
            left -= len(ready)
            yield [(i, _outcome(t)) for i, t in ready]
    finally:  # the caller went away (or the actor is shutting down): stop generating for it
        for t in tasks:
            t.cancel()


def _finished(
    done: asyncio.Queue[tuple[int, asyncio.Future[Generation]]], i: int, task: asyncio.Future[Generation]
) -> None:
    done.put_nowait((i, task))


def _outcome(task: asyncio.Future[Generation]) -> Generation | BaseException:
    if task.cancelled():
        return RuntimeError("generation cancelled in the engine")
    return task.exception() or task.result()
