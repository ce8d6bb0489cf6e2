"""The torch engine's sleep and wake (device pools), in-process on CPU.

On a CPU engine the device is the host: level 1 frees the KV cache and keeps the weights where they
are, and a round trip leaves generation bit for bit what it is without one (same seeds, same
requests: same tokens and logprobs, the engine's own sampling generator included). Level 2 drops
the weights and resets the version, so the next update loads them, whatever its version. Requests
accepted before `sleep` finish first; requests arriving while asleep wait for `wake_up` (and, after
level 2, for weights). A weight update while asleep is refused, naming the engine, and leaves its
version; a collective one is received and dropped, so the sender and the other engines go on. The
CUDA run, with the device memory freed measured, is tests/runtime/gpu/test_sleep_cuda.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from polyrl_runtime.engines.api import EngineAsleepError, Generation, SamplingParams
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.weights import TensorTarget, make_receiver, make_sender

T = TypeVar("T")

# Unseeded requests draw from the engine's own generator: a round trip must leave it as it was too.
REQUESTS = [
    ([1, 10, 11], SamplingParams(max_new_tokens=12)),
    ([1, 12], SamplingParams(max_new_tokens=9, seed=5, temperature=0.8)),
    ([1, 13, 14, 15], SamplingParams(max_new_tokens=7, allowed_ids=(30, 31, 32, 33))),
]


def _engine(uri: str = "builtin://tiny", **kw: Any) -> TorchEngine:
    return TorchEngine("e0", "p", uri, transport=kw.pop("transport", "shm"), seed=3, **kw)


async def _all(eng: TorchEngine) -> list[Generation]:
    return list(await asyncio.gather(*(eng.generate(p, s) for p, s in REQUESTS)))


def _same(a: list[Generation], b: list[Generation], *, versions: bool = True) -> bool:
    return all(
        np.array_equal(x.token_ids, y.token_ids)
        and x.logprobs.tobytes() == y.logprobs.tobytes()  # bit for bit
        and (not versions or np.array_equal(x.versions, y.versions))
        for x, y in zip(a, b, strict=True)
    )


def _weights(eng: TorchEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in eng.target.named_tensors().items()}


async def _waits(task: asyncio.Task[T], seconds: float = 0.05) -> bool:
    await asyncio.sleep(seconds)
    return not task.done()


@pytest.mark.parametrize("model", ["builtin", "hf"])
def test_a_level_1_round_trip_frees_the_kv_cache_and_leaves_generation_bit_identical(
    model: str, tiny_qwen2_dir: Path
) -> None:
    uri = "builtin://tiny" if model == "builtin" else f"file://{tiny_qwen2_dir}"
    pooled, dedicated = _engine(uri), _engine(uri)

    async def go() -> None:
        first = await _all(pooled)
        assert _same(first, await _all(dedicated))
        weights = _weights(pooled)
        report = await pooled.sleep(1)
        assert (report.engine, report.level) == ("e0", 1) and report.seconds > 0
        if model == "builtin":  # its cache has rows allocated up front; the HF one is freed when idle
            assert report.freed_bytes > 0 and pooled._cache is not None and pooled._cache.rows == 0
        assert pooled.stats().extra["asleep"] == 1
        for name, w in _weights(pooled).items():  # on a CPU engine the weights stay where they are
            assert torch.equal(w, weights[name]), name
        woken = await pooled.wake_up()
        assert (woken.level, woken.restored_bytes, woken.needs_weights) == (1, 0, False)
        assert pooled.stats().extra["asleep"] == 0
        assert _same(await _all(pooled), await _all(dedicated))
        assert _same(await _all(pooled), await _all(dedicated))  # the cache grew back the same way

    asyncio.run(go())


def test_requests_accepted_before_sleep_finish_and_later_ones_wait_for_wake_up() -> None:
    eng, reference = _engine(), _engine()

    async def go() -> None:
        long = asyncio.create_task(eng.generate([1, 10], SamplingParams(max_new_tokens=40, seed=1)))
        while not eng._active or len(eng._active[0].tokens) < 2:
            await asyncio.sleep(0.001)
        sleeping = asyncio.create_task(eng.sleep(1))
        await asyncio.sleep(0)
        late = asyncio.create_task(eng.generate([1, 11], SamplingParams(max_new_tokens=5, seed=2)))
        await sleeping
        assert long.done() and len(long.result().token_ids) == 40  # finished before the engine slept
        assert await _waits(late)
        assert (eng.stats().in_flight, eng.stats().queued) == (1, 1)
        await eng.wake_up()
        want = await reference.generate([1, 11], SamplingParams(max_new_tokens=5, seed=2))
        assert _same([await late], [want])
        assert eng.stats().in_flight == 0

    asyncio.run(go())


def test_a_weight_update_while_asleep_is_refused_and_the_version_stays() -> None:
    eng = _engine()
    sender = make_sender("shm", "p", 1 << 20)
    try:
        tensors = _weights(eng)

        async def go() -> None:
            assert (await eng.receive_weights(sender.publish(0, tensors))).applied
            await eng.sleep(1)
            v1 = sender.publish(1, {k: v + 1 for k, v in tensors.items()})
            with pytest.raises(
                EngineAsleepError,
                match=r"engine e0 is asleep \(level 1\): wake_up\(\) it before a weight update \(version 1\)",
            ):
                await eng.receive_weights(v1)
            assert eng.weight_version() == 0
            await eng.wake_up()
            assert (await eng.receive_weights(v1)).applied and eng.weight_version() == 1

        asyncio.run(go())
    finally:
        sender.close()


def test_level_2_drops_the_weights_and_the_next_update_loads_them_whatever_its_version() -> None:
    eng, reference = _engine(), _engine()
    sender = make_sender("shm", "p", 1 << 20)
    try:
        tensors = _weights(eng)
        param_bytes = sum(t.nbytes for t in tensors.values())

        async def round_trip(version: int) -> None:
            await eng.sleep(2)
            assert eng.weight_version() == -1  # it holds no version now
            woken = await eng.wake_up()
            assert (woken.level, woken.needs_weights) == (2, True)
            waiting = asyncio.create_task(eng.generate(*REQUESTS[1]))
            assert await _waits(waiting)  # no weights yet: the request waits for them
            latest = sender.latest
            again = latest is not None and latest.version == version  # the resend a late joiner gets
            manifest = latest if latest is not None and again else sender.publish(version, tensors)
            assert (await eng.receive_weights(manifest)).applied
            assert eng.weight_version() == version
            got = await waiting
            assert (got.versions == version).all()
            assert _same([got], [await reference.generate(*REQUESTS[1])], versions=False)

        async def go() -> None:
            # The weights it was built with are its own memory: level 2 releases them.
            report = await eng.sleep(2)
            assert report.freed_bytes >= param_bytes
            assert all(t.untyped_storage().nbytes() == 0 for t in eng.target.named_tensors().values())
            await eng.wake_up()
            assert (await eng.receive_weights(sender.publish(0, tensors))).applied
            # Now it serves from the shm segment (the sender's memory, which it cannot release), at
            # version 0; after level 2 the same version loads again.
            await round_trip(0)
            await round_trip(1)

        asyncio.run(go())
    finally:
        sender.close()


def test_sleep_and_wake_refuse_what_their_state_does_not_allow() -> None:
    eng = _engine()

    async def go() -> None:
        with pytest.raises(RuntimeError, match="engine e0 is awake: nothing to wake"):
            await eng.wake_up()
        with pytest.raises(ValueError, match=r"sleep level 3 is not one of \(1, 2\)"):
            await eng.sleep(3)
        await eng.sleep(1)
        with pytest.raises(EngineAsleepError, match="before sleeping again"):
            await eng.sleep(2)
        await eng.wake_up()
        await eng.pause()
        stuck = asyncio.create_task(eng.generate([1, 10], SamplingParams(max_new_tokens=3)))
        await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError, match="paused with 1 requests in flight: resume"):
            await eng.sleep(1)
        await eng.resume()  # the refused sleep left it serving
        assert len((await stuck).token_ids) == 3

    asyncio.run(go())


def _run(coro: Coroutine[Any, Any, T]) -> T | BaseException:
    try:
        return asyncio.run(coro)
    except BaseException as e:
        return e


def test_a_collective_update_while_asleep_is_dropped_and_the_other_engines_get_it() -> None:
    kw = {"host": "127.0.0.1", "timeout_s": 60.0}
    eng = _engine(transport="collective", transport_kwargs={"timeout_s": 60.0})
    tensors = _weights(eng)
    sender = make_sender("collective", "p", 1 << 16, num_receivers=2, **kw)
    peer, peer_target = (
        make_receiver("collective", timeout_s=60.0),
        TensorTarget({k: torch.zeros_like(v) for k, v in tensors.items()}),
    )
    try:
        asyncio.run(eng.sleep(1))
        manifest = sender.publish(0, {k: v + 1 for k, v in tensors.items()})
        results: dict[str, object] = {}

        def peer_receives() -> None:
            results["peer"] = peer.receive(manifest, peer_target)

        thread = threading.Thread(target=peer_receives)
        thread.start()
        results["asleep"] = _run(eng.receive_weights(manifest))
        thread.join(60)
        sender.wait()
        assert isinstance(results["asleep"], EngineAsleepError)
        assert getattr(results["peer"], "applied", False)
        assert all(torch.equal(peer_target.named_tensors()[k], v + 1) for k, v in tensors.items())
        assert eng.weight_version() == -1 and torch.equal(
            _weights(eng)["head.weight"], tensors["head.weight"]
        )
    finally:
        sender.close()
        peer.close()
