"""EnginePool batching in-process: requests of one tick coalesce into one `generate_many` call per
engine, answers stream back as each finishes (out of order), a dead engine's unanswered requests are
retried elsewhere, and `outstanding()` counts requests, not calls."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import ray

from polyrl_runtime.engines.api import EngineUnavailableError, Generation, SamplingParams
from polyrl_runtime.engines.batching import Answer, Request, stream_generations
from polyrl_runtime.engines.pool import EnginePool
from polyrl_testenv.inprocess import engine_routes


def _gen(token: int, engine: str = "") -> Generation:
    return Generation(
        np.array([token], dtype=np.int32),
        np.array([-0.5], dtype=np.float32),
        np.array([0], dtype=np.int32),
        "length",
        engine,
    )


class _Ref:
    """What a streamed item's ObjectRef is to `await`: the answers, or the error the stream ended with."""

    def __init__(self, answers: list[Answer] | BaseException) -> None:
        self.answers = answers

    def __await__(self) -> Any:
        async def get() -> list[Answer]:
            if isinstance(self.answers, BaseException):
                raise self.answers
            return self.answers

        return get().__await__()


class _Streaming:
    def __init__(self, engine: StreamEngine) -> None:
        self.engine = engine

    def options(self, **kw: Any) -> _Streaming:
        assert kw == {"num_returns": "streaming"}
        return self

    def remote(self, requests: list[Request]) -> AsyncIterator[_Ref]:
        self.engine.calls.append(list(requests))
        return self.engine.stream(requests)


class _Single:
    def __init__(self, engine: StreamEngine) -> None:
        self.engine = engine

    async def remote(self, prompt: list[int], params: SamplingParams) -> Generation:
        self.engine.single_calls += 1
        return await self.engine.answer(prompt, params)


class _Abort:
    def __init__(self, engine: StreamEngine) -> None:
        self.engine = engine

    async def remote(self, request_ids: list[str]) -> None:
        self.engine.aborted.append(list(request_ids))


class StreamEngine:
    """A fake engine actor handle: request [t] is answered with token t once `release(t)` was called
    (immediately with `auto`); `die_after` streamed items, the stream fails as a dead actor's does."""

    def __init__(self, name: str, *, auto: bool = True, die_after: int | None = None) -> None:
        self.name = name
        self.auto = auto
        self.die_after = die_after
        self.calls: list[list[Request]] = []
        self.single_calls = 0
        self.aborted: list[list[str]] = []  # the request ids of each `abort` call
        self._released: dict[int, asyncio.Event] = {}
        self.generate = _Single(self)
        self.abort = _Abort(self)
        self.generate_many = _Streaming(self)

    def _event(self, token: int) -> asyncio.Event:
        return self._released.setdefault(token, asyncio.Event())

    def release(self, token: int) -> None:
        self._event(token).set()

    async def answer(self, prompt: list[int], params: SamplingParams) -> Generation:
        if not self.auto:
            await self._event(prompt[0]).wait()
        if prompt[0] < 0:
            raise ValueError(f"bad prompt {prompt}")
        return _gen(prompt[0], self.name)

    async def stream(self, requests: list[Request]) -> AsyncIterator[_Ref]:
        items = 0
        async for answers in stream_generations(self.answer, requests):
            if self.die_after is not None and items >= self.die_after:
                yield _Ref(ray.exceptions.RayActorError())
                return
            items += 1
            yield _Ref(answers)


P = SamplingParams()


def test_requests_of_one_tick_become_one_call_per_engine() -> None:
    a, b = StreamEngine("a"), StreamEngine("b")
    pool = EnginePool(engine_routes({"p": {"a": a, "b": b}}))

    async def go() -> list[Generation]:
        return await asyncio.gather(*(pool.generate("p", [t], P) for t in range(10)))

    outs = asyncio.run(go())
    assert [int(o.token_ids[0]) for o in outs] == list(range(10))
    # balanced by in-flight count: 5 requests each, one call each
    assert len(a.calls) == len(b.calls) == 1 and len(a.calls[0]) == len(b.calls[0]) == 5
    assert a.single_calls == b.single_calls == 0 and pool.outstanding() == {}


def test_answers_stream_back_as_each_finishes() -> None:
    eng = StreamEngine("e", auto=False)
    pool = EnginePool(engine_routes({"p": {"e": eng}}))

    async def go() -> None:
        slow = asyncio.ensure_future(pool.generate("p", [1], P))
        fast = asyncio.ensure_future(pool.generate("p", [2], P))
        await asyncio.sleep(0.01)
        assert pool.outstanding() == {"e": 2} and len(eng.calls) == 1
        eng.release(2)  # the second request of the call finishes first
        assert (await asyncio.wait_for(fast, 5)).token_ids.tolist() == [2]
        assert not slow.done() and pool.outstanding() == {"e": 1}
        eng.release(1)
        assert (await asyncio.wait_for(slow, 5)).token_ids.tolist() == [1]
        assert pool.outstanding() == {}
        # a later request is a new call
        eng.release(3)
        assert (await pool.generate("p", [3], P)).token_ids.tolist() == [3]
        assert [len(c) for c in eng.calls] == [2, 1]

    asyncio.run(go())


def test_a_bad_request_fails_alone() -> None:
    pool = EnginePool(engine_routes({"p": {"e": StreamEngine("e")}}))

    async def go() -> list[Any]:
        return await asyncio.gather(*(pool.generate("p", [t], P) for t in (1, -1, 2)), return_exceptions=True)

    good, bad, other = asyncio.run(go())
    assert isinstance(bad, ValueError) and good.token_ids.tolist() == [1] and other.token_ids.tolist() == [2]


def test_dead_engine_mid_call_retries_only_the_unanswered_requests() -> None:
    dead = StreamEngine("dead", auto=False, die_after=1)
    good = StreamEngine("good")
    pool = EnginePool(engine_routes({"p": {"dead": dead}}))

    async def go() -> None:
        outs = [asyncio.ensure_future(pool.generate("p", [t], P)) for t in range(4)]
        await asyncio.sleep(0.01)
        assert pool.outstanding() == {"dead": 4} and len(dead.calls) == 1
        pool.set_routes(engine_routes({"p": {"dead": dead, "good": good}}))
        dead.release(0)  # answered before the engine dies
        assert (await asyncio.wait_for(outs[0], 5)).engine == "dead"
        for t in range(1, 4):  # the next item is the engine's death
            dead.release(t)
        rest = await asyncio.wait_for(asyncio.gather(*outs[1:]), 5)
        assert [(g.engine, int(g.token_ids[0])) for g in rest] == [("good", 1), ("good", 2), ("good", 3)]
        assert [len(c) for c in good.calls] == [3]  # the retries go out together, too
        assert pool.outstanding() == {}

    asyncio.run(go())
    assert pool.take_dead() == {"dead"}


def test_no_engine_left_after_a_death_fails_the_requests() -> None:
    pool = EnginePool(engine_routes({"p": {"dead": StreamEngine("dead", die_after=0)}}), retries=3)

    async def go() -> list[Any]:
        return await asyncio.gather(*(pool.generate("p", [t], P) for t in range(3)), return_exceptions=True)

    errors = asyncio.run(go())
    assert all(isinstance(e, EngineUnavailableError) for e in errors) and pool.outstanding() == {}


def test_cancelled_caller_is_not_answered_and_not_counted() -> None:
    eng = StreamEngine("e", auto=False)
    pool = EnginePool(engine_routes({"p": {"e": eng}}))

    async def go() -> None:
        gone = asyncio.ensure_future(pool.generate("p", [1], P))
        kept = asyncio.ensure_future(pool.generate("p", [2], P))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0)
        assert pool.outstanding() == {"e": 1}
        eng.release(1)
        eng.release(2)
        assert (await asyncio.wait_for(kept, 5)).token_ids.tolist() == [2]
        assert pool.outstanding() == {}

    asyncio.run(go())


@pytest.mark.parametrize("streams", [True, False])
def test_a_cancelled_callers_sent_request_is_aborted_on_its_engine(streams: bool) -> None:
    eng = StreamEngine("e", auto=False)
    if not streams:
        del eng.generate_many  # one `generate` call per request
    pool = EnginePool(engine_routes({"p": {"e": eng}}))

    async def go() -> None:
        unsent = asyncio.ensure_future(pool.generate("p", [3], P))
        await asyncio.sleep(0)  # started, waiting for this tick's call
        unsent.cancel()
        gone = [asyncio.ensure_future(pool.generate("p", [t], P)) for t in (1, 2)]
        kept = asyncio.ensure_future(pool.generate("p", [4], P))
        await asyncio.sleep(0.01)
        for g in gone:
            g.cancel()
        await asyncio.sleep(0.01)
        eng.release(4)
        assert (await asyncio.wait_for(kept, 5)).token_ids.tolist() == [4]

    asyncio.run(go())
    sent = [params.request_id for call in eng.calls for _, params in call]
    if streams:
        assert len(eng.calls) == 1 and len(sent) == 3  # the cancelled one was never sent
        # both cancelled callers' requests, in one call; ids unique to the pool
        assert eng.aborted == [sent[:2]] and len(set(sent)) == 3 and all(sent)
    else:
        assert eng.single_calls == 4 and [len(a) for a in eng.aborted] == [1, 2]  # each call is sent


class _SlowAbort(_Abort):
    """An abort call the engine takes only after `delay` s (a loaded engine actor)."""

    def __init__(self, engine: StreamEngine, delay: float) -> None:
        super().__init__(engine)
        self.delay = delay

    async def remote(self, request_ids: list[str]) -> None:
        await asyncio.sleep(self.delay)
        await super().remote(request_ids)


@pytest.mark.parametrize(("delay", "delivered"), [(0.2, True), (60.0, False)])
def test_a_timed_out_caller_waits_until_its_aborts_are_delivered(delay: float, delivered: bool) -> None:
    """What a timed-out episode reports follows its requests' aborts, however slow the engine is
    to take them; an engine that never takes them costs the bound, not a hang."""
    eng = StreamEngine("e", auto=False)
    eng.abort = _SlowAbort(eng, delay)
    pool = EnginePool(engine_routes({"p": {"e": eng}}))

    async def go() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pool.generate("p", [1], P), 0.05)
        assert eng.aborted == []  # sent, not yet taken
        await pool.aborts_delivered(1.0)
        assert (len(eng.aborted) == 1) is delivered
        await pool.aborts_delivered(1.0)  # nothing new to wait for, or still the bound

    asyncio.run(go())


def test_engines_without_generate_many_get_one_call_per_request() -> None:
    class Plain:
        def __init__(self) -> None:
            self.generate = _Single(StreamEngine("plain"))

    plain = Plain()
    pool = EnginePool(engine_routes({"p": {"plain": plain}}))

    async def go() -> list[Generation]:
        return await asyncio.gather(*(pool.generate("p", [t], P) for t in range(3)))

    assert [int(g.token_ids[0]) for g in asyncio.run(go())] == [0, 1, 2]
    assert plain.generate.engine.single_calls == 3


@pytest.mark.parametrize("n", [1, 5])
def test_stream_generations_yields_everything_once(n: int) -> None:
    async def answer(prompt: list[int], params: SamplingParams) -> Generation:
        await asyncio.sleep(0.001 * (n - prompt[0]))  # later requests finish first
        return _gen(prompt[0])

    async def go() -> list[list[Answer]]:
        return [a async for a in stream_generations(answer, [([t], P) for t in range(n)])]

    items = asyncio.run(go())
    flat = [i for item in items for i, _ in item]
    assert sorted(flat) == list(range(n))
    if n > 1:
        assert flat[0] == n - 1  # streamed in finishing order
