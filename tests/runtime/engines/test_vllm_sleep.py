"""The vLLM adapter's sleep and wake, on CPU, against a stand-in for vLLM's `AsyncLLM`.

What the adapter decides is checked here: it sleeps only in sleep mode (a rollout on a device pool),
calls vLLM's `sleep(level, mode="wait")` and `wake_up()` (their names and keywords are checked
against the pinned vLLM by test_vllm_contract.py), holds new requests while asleep, takes part in a
weight update while asleep without loading it and refuses it, and after level 2 waits for an update,
applied whatever its version. vLLM itself sleeping on a GPU: test_vllm_engine.py (`gpu`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from polyrl_runtime.engines import vllm_api
from polyrl_runtime.engines.api import EngineAsleepError, SamplingParams
from polyrl_runtime.engines.vllm_engine import VllmEngine
from polyrl_runtime.weights.api import WeightManifest
from polyrl_runtime.weights.buckets import TensorSpec, plan_buckets
from polyrl_runtime.weights.collective import GroupAddress
from polyrl_runtime.weights.staging import ALIGN

WEIGHTS = 600  # bytes a level-1 sleep frees on the stand-in's device (level 2: KV cache too)
KV = 300


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Any]]
    finish_reason: str = "length"
    stop_reason: Any = None
    weight_versions: Any = None


@dataclass
class _Logprob:
    logprob: float


@dataclass
class FakeLLM:
    """vLLM's `AsyncLLM` as far as the adapter uses it (asleep: requests queue, as vLLM's do)."""

    used: int = 10_000
    asleep: int = 0
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> FakeLLM:
        return cls()

    async def generate(self, prompt: Any, sampling: Any, request_id: str) -> AsyncIterator[Any]:
        while self.asleep:
            await asyncio.sleep(0.001)
        yield type(
            "Out", (), {"outputs": [_Completion([7, 8], [{7: _Logprob(-0.5)}, {8: _Logprob(-0.25)}])]}
        )()

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level, mode))
        self.asleep, self.used = level, self.used - WEIGHTS - KV

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up",))
        self.asleep, self.used = 0, self.used + WEIGHTS + KV
        return True

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> list[dict[str, Any]]:
        if method == "polyrl_device_memory":
            return [{"used": self.used}]
        self.calls.append((method, kwargs["apply"]))
        return [{"tensors": 1, "load_calls": 1, "rank": 0}]

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        pass

    async def resume_generation(self) -> None:
        pass

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        pass

    async def update_weight_version(self, new_version: str) -> None:
        self.calls.append(("version", new_version))

    def shutdown(self) -> None:
        pass


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    classes = {"AsyncLLM": FakeLLM, "AsyncEngineArgs": dict, "SamplingParams": dict}
    monkeypatch.setattr(vllm_api, "load", lambda attr: classes[attr])
    yield


def _engine(tmp_path: Path, sleep_mode: bool = True) -> VllmEngine:
    return VllmEngine("e0", "p", f"file://{tmp_path}", sleep_mode=sleep_mode)


def _manifest(version: int) -> WeightManifest:
    layout = plan_buckets([TensorSpec("w", (4,), torch.float32)], 1 << 10, ALIGN)
    return WeightManifest("p", version, "collective", layout, GroupAddress("127.0.0.1", 1, 0, 2, "gloo"))


def _llm(eng: VllmEngine) -> FakeLLM:
    llm = eng._llm
    assert isinstance(llm, FakeLLM)
    return llm


PARAMS = SamplingParams(max_new_tokens=2)


def test_only_an_engine_in_sleep_mode_sleeps(fake_vllm: None, tmp_path: Path) -> None:
    eng = _engine(tmp_path, sleep_mode=False)
    with pytest.raises(RuntimeError, match=r"engine e0 cannot sleep: .*device pool \(rollout\.pool\)"):
        asyncio.run(eng.sleep(1))
    assert _llm(eng).calls == []


def test_level_1_holds_requests_and_refuses_updates_until_wake_up(fake_vllm: None, tmp_path: Path) -> None:
    eng = _engine(tmp_path)

    async def go() -> None:
        assert (await eng.receive_weights(_manifest(3))).applied
        report = await eng.sleep(1)
        assert (report.level, report.freed_bytes) == (1, WEIGHTS + KV)
        assert _llm(eng).calls[-1] == ("sleep", 1, "wait")  # vLLM lets its requests finish
        assert eng.stats().extra["asleep"] == 1 and eng.stats().paused
        waiting = asyncio.create_task(eng.generate([1, 2], PARAMS))
        await eng.resume()  # the driver's resume does not wake it
        await asyncio.sleep(0.02)
        assert not waiting.done() and eng.stats().queued == 1
        with pytest.raises(EngineAsleepError, match=r"engine e0 is asleep \(level 1\).*version 4"):
            await eng.receive_weights(_manifest(4))
        assert _llm(eng).calls[-1] == ("polyrl_receive_version", False)  # received, not loaded
        assert eng.weight_version() == 3
        with pytest.raises(EngineAsleepError, match="before sleeping again"):
            await eng.sleep(1)
        woken = await eng.wake_up()
        assert (woken.level, woken.restored_bytes, woken.needs_weights) == (1, WEIGHTS + KV, False)
        assert (await waiting).token_ids.tolist() == [7, 8]
        with pytest.raises(RuntimeError, match="engine e0 is awake: nothing to wake"):
            await eng.wake_up()

    asyncio.run(go())


def test_after_level_2_the_next_update_loads_the_weights_whatever_its_version(
    fake_vllm: None, tmp_path: Path
) -> None:
    eng = _engine(tmp_path)

    async def go() -> None:
        assert (await eng.receive_weights(_manifest(3))).applied
        await eng.sleep(2)
        assert eng.weight_version() == -1
        woken = await eng.wake_up()
        assert woken.needs_weights
        waiting = asyncio.create_task(eng.generate([1, 2], PARAMS))
        await asyncio.sleep(0.02)
        assert not waiting.done()  # no weights: it waits for them
        assert (await eng.receive_weights(_manifest(3))).applied  # the version it had: loaded again
        assert _llm(eng).calls[-2:] == [("polyrl_receive_version", True), ("version", "3")]
        assert eng.weight_version() == 3
        assert (await waiting).versions.tolist() == [3, 3]

    asyncio.run(go())
