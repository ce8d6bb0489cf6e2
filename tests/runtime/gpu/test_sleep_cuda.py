"""The torch engine's sleep and wake on CUDA, with the device memory freed measured.

Level 1 moves the weights to host memory: the device gives back at least the bytes the report says it
freed (`torch.cuda.memory_allocated`), and after `wake_up` the same seeded requests give the same
tokens and logprobs as before the sleep (the same kernels on the same shapes). Level 2 drops the
weights; after `wake_up` the engine serves again once an update (shm, the same version) loaded them.
Figures (test properties, listed by hack/gpu/check.sh): sleep and wake seconds, bytes freed as
reported and as measured.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from polyrl_runtime.engines.api import Generation, SamplingParams

try:
    from polyrl_runtime.engines.torch_engine import TorchEngine
    from polyrl_runtime.weights import make_sender
except ModuleNotFoundError as e:  # a GPU machine without Ray, if the engine's imports ever need it
    if e.name != "ray":
        raise
    pytest.skip("the torch engine's modules cannot be imported without ray", allow_module_level=True)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = torch.device("cuda", 0)
REQUESTS = [
    ([1, 10, 11, 12], SamplingParams(max_new_tokens=24, seed=1)),
    ([1, 20], SamplingParams(max_new_tokens=16, seed=2, temperature=0.7, allowed_ids=tuple(range(40, 200)))),
]


async def _all(eng: TorchEngine) -> list[Generation]:
    return list(await asyncio.gather(*(eng.generate(p, s) for p, s in REQUESTS)))


def _same(a: list[Generation], b: list[Generation]) -> bool:
    return all(
        np.array_equal(x.token_ids, y.token_ids) and x.logprobs.tobytes() == y.logprobs.tobytes()
        for x, y in zip(a, b, strict=True)
    )


def _allocated() -> int:
    torch.cuda.synchronize(GPU)
    return torch.cuda.memory_allocated(GPU)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_device_and_wake_up_serves_the_same_tokens(
    varied_qwen2: Path, level: int, record_property: Callable[[str, object], None]
) -> None:
    eng = TorchEngine(
        "e0", "p", f"file://{varied_qwen2}", transport="shm", seed=3, device="cuda", dtype="float32"
    )
    param_bytes = sum(t.nbytes for t in eng.target.named_tensors().values())
    sender = make_sender("shm", "p", 1 << 22)
    try:
        tensors = {k: v.detach().cpu().clone() for k, v in eng.target.named_tensors().items()}

        async def go() -> None:
            before = await _all(eng)
            allocated = _allocated()
            report = await eng.sleep(level)
            freed = allocated - _allocated()
            assert report.freed_bytes >= param_bytes
            assert freed >= param_bytes and freed >= report.freed_bytes - 2**20  # blocks round up
            woken = await eng.wake_up()
            assert woken.needs_weights == (level == 2)
            if level == 1:
                assert woken.restored_bytes >= param_bytes
            else:  # the weights come from an update, here the same ones as version 0
                assert (await eng.receive_weights(sender.publish(0, tensors))).applied
            after = await _all(eng)
            assert _same(after, before)
            record_property("level", level)
            record_property("sleep_s", round(report.seconds, 4))
            record_property("wake_s", round(woken.seconds, 4))
            record_property("freed_bytes_reported", report.freed_bytes)
            record_property("freed_bytes_measured", freed)
            record_property("weight_bytes", param_bytes)

        asyncio.run(go())
    finally:
        sender.close()
