"""EnginePool over real Ray actors: `generate_many` as a streaming actor call (torch engines), and an
engine killed in the middle of a call, whose unanswered requests are retried on another engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from polyrl_runtime.engines.api import Generation, SamplingParams
from polyrl_runtime.engines.batching import Answer, Request, stream_generations
from polyrl_runtime.engines.client import EngineClient
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.engines.torch_engine import TorchEngine


def _routes(engines: dict[str, Any]) -> dict[str, dict[str, EngineClient]]:
    """Policy "p" on these engine actors, through the client the workflow workers call them with.
    (Not `polyrl_testenv`: Ray's workers import this module by name, without tests/support.)"""
    return {"p": {n: EngineClient(h) for n, h in engines.items()}}


class SlowEngine:
    """Answers request [t] with token t after t/10 s (an async actor, as the real engines)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = 0

    async def answer(self, prompt: list[int], params: SamplingParams) -> Generation:
        self.started += 1
        await asyncio.sleep(prompt[0] / 10)
        one = np.ones(1)
        return Generation(
            np.array(prompt[:1], np.int32),
            -one.astype(np.float32),
            0 * one.astype(np.int32),
            "length",
            self.name,
        )

    async def generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        return await self.answer(prompt, params)

    async def generate_many(self, requests: list[Request]) -> AsyncIterator[list[Answer]]:
        async for answers in stream_generations(self.answer, requests):
            yield answers

    def requests(self) -> int:
        return self.started


def test_torch_engines_answer_batched_calls_through_ray(ray_session: Any) -> None:
    ray = ray_session
    actor = ray.remote(num_cpus=0)(TorchEngine)
    engines = {
        f"e{i}": actor.remote(f"e{i}", "p", "builtin://tiny", transport="shm", seed=3) for i in range(2)
    }
    pool = EnginePool(_routes(engines))
    lengths = [1 + (7 * i) % 23 for i in range(12)]

    async def go() -> list[Generation]:
        return await asyncio.gather(
            *(
                pool.generate("p", [1, 10 + i % 5], SamplingParams(max_new_tokens=n))
                for i, n in enumerate(lengths)
            )
        )

    gens = asyncio.run(go())
    assert [len(g.token_ids) for g in gens] == lengths
    assert {g.engine for g in gens} == {"e0", "e1"} and pool.outstanding() == {}
    stats = ray.get([e.stats.remote() for e in engines.values()])
    assert sum(s.requests for s in stats) == 12 and all(s.in_flight == 0 for s in stats)
    for e in engines.values():
        ray.kill(e)


def test_engine_killed_mid_call_retries_its_unanswered_requests(ray_session: Any) -> None:
    ray = ray_session
    actor = ray.remote(num_cpus=0)(SlowEngine)
    doomed, spare = actor.remote("doomed"), actor.remote("spare")
    ray.get([doomed.requests.remote(), spare.requests.remote()])  # both started
    pool = EnginePool(_routes({"doomed": doomed}))
    params = SamplingParams()

    async def go() -> list[Generation]:
        outs = [asyncio.ensure_future(pool.generate("p", [t], params)) for t in (1, 30, 40)]
        first = await asyncio.wait_for(outs[0], 30)  # answered by the doomed engine before it dies
        assert first.engine == "doomed" and pool.outstanding() == {"doomed": 2}
        pool.set_routes(_routes({"doomed": doomed, "spare": spare}))
        ray.kill(doomed)
        start = time.monotonic()
        rest = await asyncio.wait_for(asyncio.gather(*outs[1:]), 60)
        assert time.monotonic() - start < 30
        return [first, *rest]

    gens = asyncio.run(go())
    assert [(g.engine, int(g.token_ids[0])) for g in gens] == [("doomed", 1), ("spare", 30), ("spare", 40)]
    assert pool.take_dead() == {"doomed"} and pool.outstanding() == {}
    assert ray.get(spare.requests.remote()) == 2
    ray.kill(spare)


def test_an_engine_that_never_started_is_marked_dead_and_its_requests_go_elsewhere(ray_session: Any) -> None:
    # Its runtime env cannot be set up (no conda here), so the actor is never created: every call to
    # it raises RuntimeEnvSetupError, as for an engine whose node's runtime-env agent failed.
    ray = ray_session
    actor = ray.remote(num_cpus=0)(SlowEngine)
    unborn = actor.options(runtime_env={"conda": "polyrl-no-such-env"}).remote("unborn")
    spare = actor.remote("spare")
    ray.get(spare.requests.remote())
    pool = EnginePool(_routes({"unborn": unborn}))

    async def go() -> list[Generation]:
        outs = [asyncio.ensure_future(pool.generate("p", [t], SamplingParams())) for t in (1, 2, 3)]
        await asyncio.sleep(0)  # the three requests are on their way to the unborn engine
        pool.set_routes(_routes({"unborn": unborn, "spare": spare}))
        return await asyncio.wait_for(asyncio.gather(*outs), 60)

    gens = asyncio.run(go())
    assert [(g.engine, int(g.token_ids[0])) for g in gens] == [("spare", 1), ("spare", 2), ("spare", 3)]
    assert pool.take_dead() == {"unborn"} and pool.outstanding() == {}
    ray.kill(spare)


def test_a_cancelled_callers_request_is_aborted_on_its_torch_engine_actor(ray_session: Any) -> None:
    """The request is on a paused engine (it would wait there, then generate to max_new_tokens);
    cancelling its caller aborts it through the streamed call's engine: counted, out of the queue."""
    ray = ray_session
    engine = ray.remote(num_cpus=0)(TorchEngine).remote("e0", "p", "builtin://tiny", transport="shm", seed=3)
    ray.get(engine.pause.remote())
    pool = EnginePool(_routes({"e0": engine}))

    async def go() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pool.generate("p", [1, 10], SamplingParams(max_new_tokens=64)), 1.0)
        for _ in range(300):
            stats = await engine.stats.remote()
            if stats.aborted:
                break
            await asyncio.sleep(0.05)
        assert (stats.aborted, stats.freed_tokens, stats.in_flight) == (1, 64, 0)
        await engine.resume.remote()
        assert len((await pool.generate("p", [1, 10], SamplingParams(max_new_tokens=3))).token_ids) == 3

    asyncio.run(go())
    assert pool.outstanding() == {}
    ray.kill(engine)
