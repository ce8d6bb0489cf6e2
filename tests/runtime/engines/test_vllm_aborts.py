"""The vLLM adapter's aborts on CPU, against a stand-in for vLLM's `AsyncLLM` that generates one token
per event-loop turn: an aborted request is aborted in vLLM by its vLLM request id (the name and
keyword are checked against the pinned vLLM by test_vllm_contract.py), its `generate` raises
`RequestAbortedError`, and it is counted with the tokens it did not generate; a request still held
by the adapter (paused) never reaches vLLM; a cancelled `generate` is aborted in vLLM too."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from polyrl_runtime.engines import vllm_api
from polyrl_runtime.engines.api import RequestAbortedError, SamplingParams
from polyrl_runtime.engines.vllm_engine import VllmEngine
from polyrl_testenv.vllm_outputs import Completion, Logprob


def _output(tokens: list[int], finish: str) -> Any:
    """A `RequestOutput` of the tokens so far (`finish` "": not finished; the adapter reads the last)."""
    completion = Completion(list(tokens), [{t: Logprob(-0.5)} for t in tokens], finish_reason=finish)
    return type("RequestOutput", (), {"outputs": [completion]})()


class StepLLM:
    """vLLM's `AsyncLLM` for generation and abort: one token per event-loop turn; `abort` ends the
    request's stream with a final output of finish reason `abort` (as vLLM's output processor does),
    and a cancelled `generate` aborts its request (as `AsyncLLM.generate` does)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.aborts: list[tuple[str, bool]] = []  # (request id, internal)
        self._stop: set[str] = set()

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> StepLLM:
        return cls()

    async def generate(
        self, prompt: Any, sampling: Any, request_id: str, lora_request: Any = None
    ) -> AsyncIterator[Any]:
        self.started.append(request_id)
        tokens: list[int] = []
        try:
            while len(tokens) < sampling["max_tokens"]:
                await asyncio.sleep(0)
                if request_id in self._stop:
                    yield _output(tokens, "abort")
                    return
                tokens.append(7)
                yield _output(tokens, "length" if len(tokens) == sampling["max_tokens"] else "")
        except asyncio.CancelledError:
            await self.abort(request_id, internal=True)
            raise

    async def abort(self, request_id: str, internal: bool = False) -> None:
        self.aborts.append((request_id, internal))
        self._stop.add(request_id)

    def shutdown(self) -> None:
        pass


@pytest.fixture
def eng(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[VllmEngine]:
    classes = {"AsyncLLM": StepLLM, "AsyncEngineArgs": dict, "SamplingParams": dict}
    monkeypatch.setattr(vllm_api, "load", lambda attr: classes[attr])
    yield VllmEngine("e0", "p", f"file://{tmp_path}")


def _llm(eng: VllmEngine) -> StepLLM:
    llm = eng._llm
    assert isinstance(llm, StepLLM)
    return llm


def _params(request_id: str, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, request_id=request_id)


async def _until(pred: Any) -> None:
    for _ in range(10_000):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def test_an_aborted_request_is_aborted_in_vllm_and_counted(eng: VllmEngine) -> None:
    async def go() -> None:
        long = asyncio.create_task(eng.generate([1, 2], _params("long", 1000)))
        await _until(lambda: "long" in eng._live and eng._live["long"].generated >= 3)
        await eng.abort(["long"])
        with pytest.raises(RequestAbortedError, match="engine e0: request long was aborted") as e:
            await long
        assert ("e0-0", False) in _llm(eng).aborts  # the adapter's own abort, by the vLLM request id
        assert 3 <= e.value.generated < 1000
        after = await eng.generate([1, 2], _params("after", 4))  # the engine serves on
        assert after.token_ids.tolist() == [7] * 4 and after.finish_reason == "length"
        st = eng.stats()
        assert (st.aborted, st.freed_tokens, st.in_flight) == (1, 1000 - e.value.generated, 0)
        assert eng._live == {}

    asyncio.run(go())


def test_a_held_request_is_aborted_before_it_reaches_vllm(eng: VllmEngine) -> None:
    async def go() -> None:
        await eng.pause()
        held = asyncio.create_task(eng.generate([1, 2], _params("held", 50)))
        await _until(lambda: eng.stats().queued == 1)
        await eng.abort(["held"])
        with pytest.raises(RequestAbortedError, match="after 0 of at most 50"):
            await held
        assert _llm(eng).started == [] and _llm(eng).aborts == []
        st = eng.stats()
        assert (st.aborted, st.freed_tokens, st.queued) == (1, 50, 0)

    asyncio.run(go())


def test_an_abort_that_comes_first_refuses_its_request(eng: VllmEngine) -> None:
    async def go() -> None:
        await eng.abort(["early"])
        with pytest.raises(RequestAbortedError, match="after 0 of at most 9"):
            await eng.generate([1], _params("early", 9))
        assert _llm(eng).started == []
        assert len((await eng.generate([1], _params("early", 2))).token_ids) == 2  # refused once

    asyncio.run(go())
    assert (eng.stats().aborted, eng.stats().freed_tokens) == (1, 9)


def test_a_cancelled_generate_is_aborted_in_vllm_and_stays_cancelled(eng: VllmEngine) -> None:
    async def go() -> None:
        gone = asyncio.create_task(eng.generate([1, 2], _params("gone", 100)))
        await _until(lambda: "gone" in eng._live and eng._live["gone"].generated >= 2)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert ("e0-0", False) in _llm(eng).aborts
        st = eng.stats()
        assert st.aborted == 1 and 0 < st.freed_tokens <= 98 and st.in_flight == 0

    asyncio.run(go())
