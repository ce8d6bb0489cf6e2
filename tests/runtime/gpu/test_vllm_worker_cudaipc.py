"""The vLLM worker extension's `cudaipc` receive on a GPU, without vLLM: a worker process (spawned, as
vLLM starts its workers) with the real `PolyrlWorkerExtension` mixed in and a stand-in model maps a
trainer's tensors through CUDA IPC and hands them to `load_weights` as views of the trainer's memory,
about a bucket at a time; the model ends bit for bit equal to the trainer's tensors, version after
version. A layout that does not fit the trainer's memory is refused before anything loads.

The extension is driven with the plain values the engine sends through vLLM's `collective_rpc`
(`handle_args`, `layout_args`). What needs no GPU: tests/runtime/engines/test_vllm_worker.py; vLLM's
own `load_weights` behind this path: test_vllm_engine.py (with vLLM installed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from polyrl_runtime.engines.vllm_worker import layout_args
from polyrl_runtime.weights.api import WeightManifest
from polyrl_runtime.weights.buckets import layout_for
from polyrl_runtime.weights.cudaipc import LAYOUT_ALIGN, CudaIpcSender
from polyrl_runtime.weights.cudaipc_handle import handle_args
from polyrl_testenv.cudaipc_engine import digest
from polyrl_testenv.ipc_worker import WorkerProcess, WorkerState

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = torch.device("cuda", 0)
BUCKET = 1 << 16


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    process = WorkerProcess()
    try:
        yield process
    finally:
        process.close()


class Trainer:
    """A trainer's weights under Hugging Face names: bf16 and fp32, two tensors that are views of one
    flat buffer (as DeepSpeed's are; the second starts 600 bytes into it), one published transposed
    (not contiguous), larger ones that span buckets. `step` rewrites them in place."""

    def __init__(self) -> None:
        self._g = torch.Generator().manual_seed(0)
        self.flat = torch.empty(4099, dtype=torch.bfloat16, device=GPU)
        self.embed = torch.empty(1000, 64, dtype=torch.bfloat16, device=GPU)  # 125 KiB: two buckets
        self.layers = [torch.empty(128, 64, device=GPU) for _ in range(4)]  # 32 KiB each
        self.wide = torch.empty(37, 129, device=GPU)
        self.norm = torch.empty(64, device=GPU)
        self.step()

    def step(self) -> None:
        for t in (self.flat, self.embed, *self.layers, self.wide, self.norm):
            t.copy_(torch.randn(t.shape, generator=self._g).to(t.dtype))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "model.embed_tokens.weight": self.embed,
            **{f"model.layers.{i}.mlp.weight": t for i, t in enumerate(self.layers)},
            "model.flat.a": self.flat[:300].view(20, 15),
            "model.flat.b": self.flat[300:1001],
            "model.wide.weight": self.wide.t(),
            "model.norm.weight": self.norm,
        }

    def spec(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(name, tuple(t.shape), t.dtype) for name, t in self.tensors().items()]

    def digests(self) -> dict[str, str]:
        return {name: digest(t) for name, t in self.tensors().items()}


def _rpc_kwargs(manifest: WeightManifest, layout: dict[str, Any] | None = None) -> dict[str, Any]:
    """What `VllmEngine` sends its workers for a cudaipc manifest."""
    return {
        "policy": manifest.policy,
        "version": manifest.version,
        "handle": handle_args(manifest.handle),
        "layout": layout if layout is not None else layout_args(manifest.layout, LAYOUT_ALIGN),
        "timeout_s": 30.0,
    }


def _ok(state: WorkerState) -> WorkerState:
    assert not state.result.get("error"), state.result
    return state


def test_the_worker_loads_each_version_from_the_trainers_memory_bit_exact(worker: WorkerProcess) -> None:
    trainer = Trainer()
    sender = CudaIpcSender("alice", BUCKET)
    worker.model(trainer.spec())
    size = {name: t.numel() * t.element_size() for name, t in trainer.tensors().items()}
    try:
        seen = 0
        for version in range(2):
            if version:
                sender.release_source()  # before the trainer's step, as TrainerWeights does
                trainer.step()
            got = _ok(worker.receive_ipc(**_rpc_kwargs(sender.publish(version, trainer.tensors()))))
            assert got.result == {
                "load_calls": len(got.batches) - seen,
                "tensors": len(size),
                "written": True,
            }
            assert got.digests == trainer.digests()
            batches, seen = got.batches[seen:], len(got.batches)
            # About a bucket at a time (never more than a bucket plus its largest tensor), in order.
            assert len(batches) > 1
            assert [t.name for b in batches for t in b] == list(size)
            assert all(sum(t.nbytes for t in b) < BUCKET + max(size.values()) for b in batches)
            # Views of the trainer's memory on its GPU: the second tensor of the shared buffer lies
            # 600 bytes into the storage the trainer shares.
            loaded = {t.name: t for b in batches for t in b}
            assert loaded["model.flat.b"].storage_offset == 600
            assert {t.device for t in loaded.values()} == {"cuda:0"}
        held = got
    finally:
        sender.close()

    # The next trainer run (a new sender): layouts that do not fit its memory load nothing.
    sender = CudaIpcSender("alice", BUCKET)
    trainer.step()
    try:
        manifest = sender.publish(2, trainer.tensors())
        good = layout_args(manifest.layout, LAYOUT_ALIGN)
        bigger = {**trainer.tensors(), "model.norm.weight": torch.zeros(65, device=GPU)}
        refused = [
            # Does not rebuild to the sender's digest (a tampered shape).
            {**good, "specs": [(n, [*s[:-1], s[-1] + 1], d) for n, s, d in good["specs"]]},
            # Rebuilds, but names more bytes of `norm` than the trainer's storage holds.
            layout_args(layout_for(bigger, BUCKET, LAYOUT_ALIGN), LAYOUT_ALIGN),
            # Rebuilds, one tensor fewer than the handle places.
            layout_args(
                layout_for(dict(list(trainer.tensors().items())[:-1]), BUCKET, LAYOUT_ALIGN), LAYOUT_ALIGN
            ),
        ]
        reasons = [
            "digest mismatch",
            "does not lie in the trainer's memory",
            "places 9 tensors, the layout has 8",
        ]
        for layout, reason in zip(refused, reasons, strict=True):
            got = worker.receive_ipc(**_rpc_kwargs(manifest, layout))
            assert reason in str(got.result.get("error")), got.result
            assert got.result["written"] is False
            assert (got.batches, got.digests) == (held.batches, held.digests)  # nothing loaded
        # The layout that fits: loaded.
        got = _ok(worker.receive_ipc(**_rpc_kwargs(manifest)))
        assert got.digests == trainer.digests() and len(got.batches) > len(held.batches)
    finally:
        sender.close()


def test_a_version_the_trainer_no_longer_serves_loads_nothing(worker: WorkerProcess) -> None:
    trainer = Trainer()
    sender = CudaIpcSender("alice", BUCKET)
    before = worker.model(trainer.spec())
    try:
        manifest = sender.publish(0, trainer.tensors())
        sender.release_source()
        trainer.step()
        got = worker.receive_ipc(**_rpc_kwargs(manifest))
        assert "version 0 is no longer served" in str(got.result.get("error"))
        assert got.result["written"] is False and got.batches == before.batches == []
    finally:
        sender.close()
