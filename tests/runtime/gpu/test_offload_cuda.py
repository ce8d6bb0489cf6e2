"""A trainer rank's offload to host memory and restore on CUDA, with the device memory freed measured.

`trainers/offload.py` on a model and its AdamW as the trainer builds them, without DeepSpeed (the GPU
tier's machine has none; DeepSpeed's ZeRO stages go through the same walk, on CPU, in
tests/runtime/trainers/test_offload.py). After a training step: offloading frees on the device at
least every byte it moved (`torch.cuda.memory_allocated`), restoring gives back every storage bit for
bit, and the next step lands where the same step lands from a state that never left the device (to
rounding: CUDA kernels with atomics may differ in the last bits between any two runs; on CPU the
test holds it bit for bit). Figures (recorded as test properties, listed by hack/gpu/check.sh):
bytes moved, device bytes freed, offload and restore seconds and GB/s.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from polyrl_runtime.device_memory import HostBuffers
from polyrl_runtime.models import load_model
from polyrl_runtime.trainers.offload import offload_rank, rank_storages, restore_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = torch.device("cuda", 0)


def _rank(model: torch.nn.Module) -> Any:
    """What `offload_rank` reads of a DeepSpeed engine: its module and its optimizer."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    return SimpleNamespace(module=model, optimizer=opt)


def _step(rank: Any, loss: Callable[[torch.nn.Module], torch.Tensor]) -> None:
    rank.optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: they are offloaded too
    torch.autograd.backward(loss(rank.module))
    rank.optimizer.step()


def _lm_loss(model: torch.nn.Module) -> torch.Tensor:
    ids = (torch.arange(64, device=GPU).reshape(4, 16) * 7) % 300
    logits: torch.Tensor = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def _mlp_loss(model: torch.nn.Module) -> torch.Tensor:
    out: torch.Tensor = model(torch.ones(8, 4096, device=GPU))
    return out.float().pow(2).mean()


def _snapshot(rank: Any) -> list[torch.Tensor]:
    return [
        torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).clone()
        for s in rank_storages(rank, None, GPU)
    ]


def _round_trip(
    rank: Any, record: Callable[[str, object], None], buffers: HostBuffers | None = None, prefix: str = ""
) -> None:
    before = _snapshot(rank)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated(GPU)
    parked = offload_rank(rank, None, GPU, buffers)
    freed = allocated - torch.cuda.memory_allocated(GPU)
    assert parked.nbytes == parked.host_bytes == sum(b.numel() for b in before) > 0
    assert parked.kept_bytes == 0
    assert freed >= parked.nbytes  # every moved byte left the device (allocator blocks round up)
    restore_s = restore_rank(parked, "test")
    assert torch.cuda.memory_allocated(GPU) == allocated
    after = _snapshot(rank)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    gb = parked.nbytes / 1e9
    record(prefix + "moved_bytes", parked.nbytes)
    record(prefix + "device_bytes_freed", freed)
    record(prefix + "offload_s", round(parked.seconds, 4))
    record(prefix + "restore_s", round(restore_s, 4))
    record(prefix + "offload_gbps", round(gb / parked.seconds, 2))
    record(prefix + "restore_gbps", round(gb / restore_s, 2))


def test_offload_and_restore_a_trained_model_and_its_optimizer(
    varied_qwen2: Path, record_property: Callable[[str, object], None]
) -> None:
    pooled, dedicated = (
        _rank(load_model(f"file://{varied_qwen2}", dtype="float32", cuda=True).to(GPU)) for _ in "ab"
    )
    for rank in (pooled, dedicated):
        _step(rank, _lm_loss)
    _round_trip(pooled, record_property)
    for rank in (pooled, dedicated):
        _step(rank, _lm_loss)
    for (name, p), q in zip(pooled.module.named_parameters(), dedicated.module.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    steps = [s["step"] for s in pooled.optimizer.state.values()]
    assert steps and all(int(s) == 2 for s in steps)


def test_offload_throughput_at_a_gigabyte(record_property: Callable[[str, object], None]) -> None:
    """About 1.1 GB of state (a 4 x 4096^2 float32 MLP: weights, gradients, two Adam moments): the
    figures a pool's switch time is made of."""
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False) for _ in range(4))).to(GPU)
    rank = _rank(model)
    _step(rank, _mlp_loss)
    _round_trip(rank, record_property)
    _step(rank, _mlp_loss)  # trains on after the round trip
    # A pooled rank offloads every turn into the same pinned buffers: the second turn pins nothing.
    buffers = HostBuffers()
    _round_trip(rank, lambda k, v: None, buffers)
    pinned = buffers.allocated
    _step(rank, _mlp_loss)
    _round_trip(rank, record_property, buffers, prefix="reused_")
    assert buffers.allocated == pinned > 0  # the second offload pinned nothing new
