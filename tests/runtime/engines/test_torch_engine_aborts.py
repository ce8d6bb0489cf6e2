"""Aborts in the torch engine, in-process: an aborted request (`Engine.abort`, or a cancelled
`generate`) stops before the next step, leaves its batch slot and cache row to the next request, and
is counted with the tokens it did not generate; the built-in model and a Hugging Face one alike."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from polyrl_runtime.engines.api import RequestAbortedError, SamplingParams
from polyrl_runtime.engines.torch_engine import TorchEngine

LONG = 100  # tokens a long request may generate; the test aborts it long before


@pytest.fixture(params=["tiny", "hf"])
def engine(request: pytest.FixtureRequest, tiny_qwen2_dir: Path) -> TorchEngine:
    """One batch slot: a second request runs only once the first has left the batch."""
    uri = "builtin://tiny" if request.param == "tiny" else f"file://{tiny_qwen2_dir}"
    return TorchEngine("e0", "p", uri, transport="shm", seed=3, dtype="float32", max_batch=1)


def _params(request_id: str, max_new_tokens: int = LONG) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, allowed_ids=(30, 31), request_id=request_id)


async def _until_generated(eng: TorchEngine, n: int) -> int:
    """Wait until the running request has `n` tokens; how many it has."""
    for _ in range(10_000):
        if eng._active and len(eng._active[0].tokens) >= n:
            return len(eng._active[0].tokens)
        await asyncio.sleep(0)
    raise AssertionError(f"the running request never reached {n} tokens")


def test_an_aborted_request_stops_frees_its_slot_and_counts_the_freed_tokens(engine: TorchEngine) -> None:
    async def go() -> None:
        long = asyncio.create_task(engine.generate([1, 10, 11], _params("long")))
        after = asyncio.create_task(engine.generate([1, 12], _params("after", 5)))
        await _until_generated(engine, 3)
        assert engine.stats().queued == 1  # `after` waits for the one slot
        await engine.abort(["long"])
        assert engine.stats().aborted == 1  # counted once the abort returns, before the loop drops it
        with pytest.raises(
            RequestAbortedError, match=r"engine e0: request long was aborted .* of at most 100"
        ) as e:
            await long
        assert 3 <= e.value.generated < LONG
        g = await asyncio.wait_for(after, 30)  # the freed slot serves the next request
        assert len(g.token_ids) == 5 and g.finish_reason == "length"
        st = engine.stats()
        # It stopped at the step after the abort (one running in a thread when it came still counts);
        # the freed tokens are those it had not generated when aborted.
        generated = st.tokens - 5
        assert generated - e.value.generated in (0, 1)
        assert (st.aborted, st.freed_tokens, st.in_flight) == (1, LONG - e.value.generated, 0)
        assert engine._by_id == {}

    asyncio.run(go())


def test_a_cancelled_generate_is_dropped_and_counted_like_an_abort(engine: TorchEngine) -> None:
    async def go() -> None:
        gone = asyncio.create_task(engine.generate([1, 10, 11], _params("gone")))
        generated = await _until_generated(engine, 2)
        gone.cancel()
        g = await asyncio.wait_for(engine.generate([1, 12], _params("next", 4)), 30)
        assert len(g.token_ids) == 4
        assert gone.cancelled()
        st = engine.stats()
        assert st.aborted == 1 and st.in_flight == 0
        assert st.freed_tokens == LONG - (st.tokens - 4) and st.tokens - 4 >= generated

    asyncio.run(go())


def test_an_abort_that_comes_first_refuses_its_request_and_unknown_ids_are_harmless() -> None:
    eng = TorchEngine("e0", "p", "builtin://tiny", transport="shm", seed=3)

    async def go() -> None:
        await eng.abort(["early", "never-sent", ""])
        with pytest.raises(RequestAbortedError, match="request early was aborted by its caller after 0 of"):
            await eng.generate([1, 10], _params("early", 8))
        g = await eng.generate([1, 10], _params("early", 8))  # the abort refused one request only
        assert len(g.token_ids) == 8
        await eng.abort(["early"])  # finished: nothing to stop
        st = eng.stats()
        assert (st.aborted, st.freed_tokens, st.in_flight) == (1, 8, 0)

    asyncio.run(go())


def test_aborting_a_queued_request_while_paused() -> None:
    eng = TorchEngine("e0", "p", "builtin://tiny", transport="shm", seed=3)

    async def go() -> None:
        await eng.pause()
        waiting = asyncio.create_task(eng.generate([1, 10], _params("q", 6)))
        await asyncio.sleep(0.01)
        assert eng.stats().queued == 1
        await eng.abort(["q"])
        with pytest.raises(RequestAbortedError, match="after 0 of at most 6"):
            await waiting
        await asyncio.sleep(0.01)
        st = eng.stats()
        assert (st.aborted, st.freed_tokens, st.in_flight) == (1, 6, 0)

    asyncio.run(go())
