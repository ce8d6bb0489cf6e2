"""The vLLM adapter's sleep and wake, and where it sends weight updates, on CPU, against a stand-in for
vLLM's `AsyncLLM`.

What the adapter decides is checked here: it sleeps only in sleep mode (a rollout on a device pool),
calls vLLM's `sleep(level, mode="wait")` and `wake_up()` (their names and keywords are checked
against the pinned vLLM by test_vllm_contract.py), holds new requests while asleep, takes part in a
collective weight update while asleep without loading it and refuses it (a cudaipc one it just
refuses), and after level 2 waits for an update, applied whatever its version. A cudaipc update goes
to the workers' `polyrl_receive_ipc` in plain values. vLLM itself sleeping on a GPU:
test_vllm_engine.py (`gpu`).
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
from polyrl_runtime.weights.api import VersionError, WeightManifest, WeightSyncError
from polyrl_runtime.weights.buckets import TensorSpec, plan_buckets
from polyrl_runtime.weights.collective_group import GroupAddress
from polyrl_runtime.weights.cudaipc import LAYOUT_ALIGN
from polyrl_runtime.weights.cudaipc_handle import CudaIpcHandle, handle_from_args
from polyrl_runtime.weights.staging import ALIGN
from polyrl_testenv.vllm_outputs import two_tokens

WEIGHTS = 600  # bytes a level-1 sleep frees on the stand-in's device (level 2: KV cache too)
KV = 300


@dataclass
class FakeLLM:
    """vLLM's `AsyncLLM` as far as the adapter uses it (asleep: requests queue, as vLLM's do)."""

    used: int = 10_000
    asleep: int = 0
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    rpc_kwargs: list[dict[str, Any]] = field(default_factory=list)
    # What each worker answers a weight update (one entry per tensor-parallel rank).
    results: list[dict[str, Any]] = field(
        default_factory=lambda: [{"tensors": 1, "load_calls": 1, "written": True, "rank": 0}]
    )

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> FakeLLM:
        return cls()

    async def generate(
        self, prompt: Any, sampling: Any, request_id: str, lora_request: Any = None
    ) -> AsyncIterator[Any]:
        while self.asleep:
            await asyncio.sleep(0.001)
        yield two_tokens()

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
        self.calls.append((method, kwargs.get("apply", True)))
        self.rpc_kwargs.append(kwargs)
        return self.results

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


def _engine(tmp_path: Path, sleep_mode: bool = True, transport: str = "collective") -> VllmEngine:
    return VllmEngine("e0", "p", f"file://{tmp_path}", sleep_mode=sleep_mode, transport=transport)


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


# -- which transport a weight update goes through


def _ipc_manifest(version: int) -> WeightManifest:
    layout = plan_buckets([TensorSpec("w", (4,), torch.float32)], 1 << 10, LAYOUT_ALIGN)
    storage = (
        *(torch.Tensor, torch.Size([16]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0),
        *(b"h" * 64, 16, 0, False, b"/polyrl-cudaipc-p.counts", 0, b"e" * 64, False),
    )
    handle = CudaIpcHandle("GPU-5e1f", "1-b", "s", "/dev/shm/g", (storage,), ((0, 0),))
    return WeightManifest("p", version, "cudaipc", layout, handle)


def _plain(value: object) -> bool:
    """What vLLM's `collective_rpc` carries without insecure serialization."""
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, bool | int | float | str | bytes)


def test_engine_vllm_receives_through_collective_or_cudaipc(fake_vllm: None, tmp_path: Path) -> None:
    for transport in ("collective", "cudaipc"):
        _engine(tmp_path, transport=transport)
    with pytest.raises(ValueError, match=r"through collective \(NCCL\) or cudaipc .*transport is 'shm'"):
        _engine(tmp_path, transport="shm")
    eng = _engine(tmp_path, transport="cudaipc")
    shm = WeightManifest("p", 0, "shm", _manifest(0).layout, "/dev/shm/segment")
    with pytest.raises(WeightSyncError, match="manifest of transport 'shm', not collective or cudaipc"):
        asyncio.run(eng.receive_weights(shm))
    assert _llm(eng).calls == []


def test_a_cudaipc_update_goes_to_the_workers_ipc_receive_in_plain_values(
    fake_vllm: None, tmp_path: Path
) -> None:
    eng = _engine(tmp_path, transport="cudaipc")
    manifest = _ipc_manifest(3)

    async def go() -> None:
        assert (await eng.receive_weights(manifest)).applied
        assert _llm(eng).calls == [("polyrl_receive_ipc", True), ("version", "3")]
        sent = _llm(eng).rpc_kwargs[-1]
        assert _plain(sent) and (sent["policy"], sent["version"]) == ("p", 3)
        assert handle_from_args(sent["handle"]) == manifest.handle
        assert sent["layout"]["align"] == LAYOUT_ALIGN
        # A resend of the version it holds, an older version: no worker is asked (nothing to drain).
        assert not (await eng.receive_weights(manifest)).applied
        with pytest.raises(VersionError):
            await eng.receive_weights(_ipc_manifest(2))
        assert len(_llm(eng).calls) == 2 and eng.weight_version() == 3

    asyncio.run(go())


def test_a_cudaipc_update_while_asleep_is_refused_and_reaches_no_worker(
    fake_vllm: None, tmp_path: Path
) -> None:
    eng = _engine(tmp_path, transport="cudaipc")

    async def go() -> None:
        assert (await eng.receive_weights(_ipc_manifest(3))).applied
        await eng.sleep(1)
        before = list(_llm(eng).calls)
        with pytest.raises(EngineAsleepError, match=r"engine e0 is asleep \(level 1\).*version 4"):
            await eng.receive_weights(_ipc_manifest(4))
        assert _llm(eng).calls == before and eng.weight_version() == 3
        await eng.wake_up()
        assert (await eng.receive_weights(_ipc_manifest(4))).applied and eng.weight_version() == 4

    asyncio.run(go())


@pytest.mark.parametrize(
    ("results", "mixed"),
    [
        ([{"error": "WeightSyncError: no longer served", "written": False}] * 2, False),
        ([{"tensors": 1, "written": True}, {"error": "WeightSyncError: guard gone", "written": False}], True),
    ],
    ids=["every-rank-refused", "one-rank-loaded"],
)
def test_a_failed_update_retires_the_engine_when_any_rank_wrote(
    fake_vllm: None, tmp_path: Path, results: list[dict[str, Any]], mixed: bool
) -> None:
    """Tensor-parallel ranks read the trainer's memory each on their own: one may load while another
    fails, and then the served model is mixed across ranks."""
    eng = _engine(tmp_path, transport="cudaipc")
    _llm(eng).results = results
    retired: list[str] = []

    async def retire(reason: str) -> None:
        retired.append(reason)

    eng._retire = retire  # type: ignore[method-assign]  # the real one exits the process
    with pytest.raises(WeightSyncError):
        asyncio.run(eng.receive_weights(_ipc_manifest(0)))
    assert bool(retired) is mixed and eng.weight_version() == -1
