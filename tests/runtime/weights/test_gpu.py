"""GPU paths: engines with CUDA parameters, and the NCCL collective. Skipped on machines without GPUs."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from weights_harness import bit_equal, random_tensors

from polyrl_runtime.weights import TensorTarget, make_receiver, make_sender
from polyrl_runtime.weights.collective import CollectiveReceiver, CollectiveSender

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL, CUDA parameters)"),
]

SPEC = {
    "w": ((1024, 257), torch.bfloat16),
    "b": ((257,), torch.float32),
    "h": ((33, 7), torch.float16),
    "i": ((5,), torch.int64),
}


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_cuda_engine_parameters(transport: str) -> None:
    # Trainer weights on the GPU, engine weights on the GPU; shm and gloo stage through host memory.
    tensors = {k: v.cuda() for k, v in random_tensors(SPEC).items()}
    kwargs: dict[str, Any] = (
        {"num_receivers": 1, "host": "127.0.0.1", "device": "cpu"} if transport == "collective" else {}
    )
    sender = make_sender(transport, "p", 1 << 20, **kwargs)
    receiver = make_receiver(transport)
    target = TensorTarget({k: torch.zeros_like(v) for k, v in tensors.items()})
    manifest = sender.publish(0, tensors)
    try:
        report = receiver.receive(manifest, target)
        sender.wait()
    finally:
        sender.close()
    assert report.applied
    for k, t in tensors.items():
        assert bit_equal(target.named_tensors()[k].cpu(), t.cpu()), k


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one rank per GPU)")
def test_nccl_round_trip() -> None:
    tensors = {k: v.to("cuda:0") for k, v in random_tensors(SPEC).items()}
    sender = CollectiveSender(
        "p", 1 << 20, num_receivers=1, backend="nccl", device="cuda:0", host="127.0.0.1"
    )
    receiver = CollectiveReceiver(device="cuda:1")
    target = TensorTarget({k: torch.zeros_like(v, device="cuda:1") for k, v in tensors.items()})
    out: dict[str, Any] = {}

    def recv(manifest: Any) -> None:
        torch.cuda.set_device(1)
        try:
            out["report"] = receiver.receive(manifest, target)
        except BaseException as e:
            out["error"] = e

    try:
        for version in range(2):
            tensors = {
                k: (v + version).to(v.dtype) if v.dtype != torch.int64 else v + version
                for k, v in tensors.items()
            }
            t = threading.Thread(target=recv, args=(sender.publish(version, tensors),))
            t.start()
            sender.wait()
            t.join()
            assert "error" not in out, out.get("error")
            assert out["report"].applied and target.version == version
            for k, v in tensors.items():
                assert bit_equal(target.named_tensors()[k].cpu(), v.cpu()), k
    finally:
        sender.close()
