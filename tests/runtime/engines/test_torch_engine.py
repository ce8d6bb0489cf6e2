"""The torch engine in-process (no Ray): constrained decoding, stops, batching, and weight updates
that land between two tokens of an unfinished generation (partial rollouts keep per-token versions)."""

from __future__ import annotations

import asyncio

import pytest

from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.models import build_tiny
from polyrl_runtime.weights import make_sender


def _engine(**kw: object) -> TorchEngine:
    return TorchEngine("e0", "p", "builtin://tiny", transport="shm", seed=3, **kw)  # type: ignore[arg-type]


def test_constrained_decoding_length_and_stop() -> None:
    eng = _engine()

    async def go() -> None:
        g = await eng.generate([1, 10, 11], SamplingParams(max_new_tokens=7, allowed_ids=(30, 31, 32)))
        assert len(g.token_ids) == 7 and set(g.token_ids.tolist()) <= {30, 31, 32}
        assert g.finish_reason == "length" and len(g.logprobs) == len(g.versions) == 7
        assert (g.logprobs <= 0).all()
        # only the stop token allowed: it is produced first and ends the generation
        s = await eng.generate([1, 10], SamplingParams(max_new_tokens=9, allowed_ids=(2,), stop_ids=(2,)))
        assert s.token_ids.tolist() == [2] and s.finish_reason == "stop"
        greedy = [
            await eng.generate([1, 12, 13], SamplingParams(temperature=0, max_new_tokens=4)) for _ in range(2)
        ]
        assert greedy[0].token_ids.tolist() == greedy[1].token_ids.tolist()
        with pytest.raises(ValueError, match="empty prompt"):
            await eng.generate([], SamplingParams())

    asyncio.run(go())


def test_concurrent_requests_share_forward_passes() -> None:
    eng = _engine()

    async def go() -> None:
        outs = await asyncio.gather(
            *(eng.generate([1, 10 + i % 5], SamplingParams(max_new_tokens=1 + i % 3)) for i in range(40))
        )
        assert [len(o.token_ids) for o in outs] == [1 + i % 3 for i in range(40)]

    asyncio.run(go())
    st = eng.stats()
    assert st.requests == 40 and st.tokens == sum(1 + i % 3 for i in range(40)) and st.in_flight == 0
    # continuous batching: far fewer forward passes than tokens
    assert st.extra["forward_passes"] < st.tokens / 4


def test_weight_update_lands_mid_generation_and_versions_are_recorded() -> None:
    eng = _engine()
    sender = make_sender("shm", "p", 1 << 20)
    try:
        v0 = sender.publish(0, dict(eng.target.named_tensors()))
        other = build_tiny("tiny", 64, seed=99)
        v1_tensors = {k: p.detach().clone() for k, p in other.named_parameters()}

        async def go() -> list[int]:
            assert (await eng.receive_weights(v0)).applied
            task = asyncio.create_task(eng.generate([1, 10], SamplingParams(max_new_tokens=30)))
            while not eng._active or len(eng._active[0].tokens) < 3:
                await asyncio.sleep(0.001)
            await eng.pause()
            v1 = sender.publish(1, v1_tensors)
            assert (await eng.receive_weights(v1)).applied
            await eng.resume()
            return (await task).versions.tolist()

        versions = asyncio.run(go())
    finally:
        sender.close()
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert eng.weight_version() == 1
