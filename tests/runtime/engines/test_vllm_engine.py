"""The vLLM adapter: its weight staging on any machine, the engine itself on a GPU machine."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest
import torch

from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.vllm_engine import StagingTarget
from polyrl_runtime.weights import make_receiver, make_sender


def test_staging_target_takes_the_trainers_layout_and_hands_over_complete_versions() -> None:
    applied: list[dict[str, torch.Tensor]] = []
    target = StagingTarget(lambda t: applied.append({k: v.clone() for k, v in t.items()}))
    sender, receiver = make_sender("shm", "p", 1 << 16), make_receiver("shm")
    try:
        for version in range(2):
            weights = {
                "model.embed.weight": torch.full((4, 3), float(version)),
                "lm_head.bias": torch.arange(3.0),
            }
            manifest = sender.publish(version, weights)
            target.prepare(manifest)
            assert receiver.receive(manifest, target).applied
            assert target.version == version
            assert torch.equal(applied[-1]["model.embed.weight"], weights["model.embed.weight"])
    finally:
        sender.close()
        receiver.close()
    assert len(applied) == 2


@pytest.mark.gpu
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
    reason="needs vLLM and a CUDA GPU",
)
def test_vllm_engine_generates_constrained_tokens_with_logprobs() -> None:
    from polyrl_runtime.engines.vllm_engine import VllmEngine

    model = os.environ.get("POLYRL_TEST_VLLM_MODEL", "")
    if not model:
        pytest.skip("set POLYRL_TEST_VLLM_MODEL=file:///path/to/a/small/hf/model")
    engine = VllmEngine("e0", "p", model, transport="objectstore", gpu_memory_utilization=0.3)

    async def go() -> None:
        g = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, allowed_ids=(100, 101)))
        assert set(g.token_ids.tolist()) <= {100, 101} and len(g.logprobs) == len(g.token_ids)
        assert (g.logprobs <= 0).all()

    asyncio.run(go())
