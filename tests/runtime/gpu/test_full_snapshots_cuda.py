"""A full-weight league snapshot on CUDA (engines/full_snapshots.py): the host copy is loaded into a
serving copy of the model on the device, which replies exactly as the engine did while it served that
version (the same kernels on the same weights), and holds one model's bytes on the device.
Figures (test properties, listed by hack/gpu/check.sh): the switch seconds and the device bytes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from polyrl_runtime.engines.api import SamplingParams

try:
    from polyrl_runtime.engines.torch_engine import TorchEngine
except ModuleNotFoundError as e:  # a GPU machine without Ray, if the engine's imports ever need it
    if e.name != "ray":
        raise
    pytest.skip("the torch engine's modules cannot be imported without ray", allow_module_level=True)

from polyrl_testenv.models import moved_model, publish_full

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT = [1, 10, 11, 12, 13]
GREEDY = SamplingParams(temperature=0, max_new_tokens=16)


async def _publish(eng: TorchEngine, model: Any, version: int) -> None:
    await publish_full(eng, model, version, "player")


def test_a_snapshot_replies_from_a_device_copy_as_the_engine_did(
    varied_qwen2: Path, record_property: Any
) -> None:
    eng = TorchEngine(
        "e0", "player", f"file://{varied_qwen2}", transport="shm", seed=3, dtype="float32", device="cuda"
    )
    first, second = moved_model(varied_qwen2, 1), moved_model(varied_qwen2, 2)

    async def go() -> None:
        await _publish(eng, first, 1)
        then = await eng.generate(PROMPT, GREEDY)
        await eng.snapshot("player", 2)
        await _publish(eng, second, 2)
        past = await eng.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=16, snapshot=1))
        assert past.token_ids.tolist() == then.token_ids.tolist() and (past.versions == 1).all()
        assert past.logprobs.tobytes() == then.logprobs.tobytes()
        now = await eng.generate(PROMPT, GREEDY)
        assert (now.versions == 2).all()

    asyncio.run(go())
    full = eng.full_snapshots
    assert full is not None and full.switches == 1
    model_bytes = sum(p.nbytes for p in first.parameters())
    assert full.serving_nbytes() == model_bytes and full.host_nbytes() == model_bytes
    record_property("switch_s", round(full.switch_s, 4))
    record_property("device_bytes", full.serving_nbytes())
