"""Published weights are what an inference model loads, under every ZeRO stage.

A trainer built by `build_trainer` (DeepSpeed, gloo, world 1, in this process) takes one optimizer
step; what it publishes must have exactly the names and shapes of
`AutoModelForCausalLM.from_pretrained(dir).named_parameters()` (no buffers, the tied `lm_head`
once), and a fresh Hugging Face model's `TensorTarget.from_module` must accept it through a real
transport and then compute what the trainer computes. Under ZeRO-3 the gathers go bucket by bucket.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from polyrl_operator.api import Policy
from polyrl_runtime.trainers.build import build_trainer
from polyrl_runtime.trainers.export import zero_gather
from polyrl_runtime.trainers.publish import buckets, hf_name, published_tensors
from polyrl_runtime.weights import TensorTarget, WeightMismatchError, make_receiver, make_sender

CPU = torch.device("cpu")
IDS = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 12]])


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("module.model.norm.weight", "model.norm.weight"),
        ("_orig_mod.module.lm_head.weight", "lm_head.weight"),
        ("module._orig_mod.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("model.module_list.0.weight", "model.module_list.0.weight"),  # only leading prefixes
    ],
)
def test_hf_name_strips_wrapper_prefixes(name: str, expected: str) -> None:
    assert hf_name(name) == expected


@pytest.mark.parametrize(
    ("sizes", "bucket_bytes", "expected"),
    [
        ([4, 4, 4], 8, [[0, 1], [2]]),
        ([4, 4, 4], 12, [[0, 1, 2]]),
        ([20, 4, 4], 8, [[0], [1, 2]]),  # larger than a bucket: a group of its own
        ([4, 20, 4], 8, [[0], [1], [2]]),
        ([], 8, []),
    ],
)
def test_buckets_group_consecutive_parameters_by_bytes(
    sizes: list[int], bucket_bytes: int, expected: list[list[int]]
) -> None:
    params = [(str(i), torch.nn.Parameter(torch.zeros(n // 4))) for i, n in enumerate(sizes)]
    assert [[int(n) for n, _ in g] for g in buckets(params, bucket_bytes)] == expected


def _transfer(tensors: dict[str, torch.Tensor], target: TensorTarget) -> None:
    """Publish `tensors` over shared memory and apply them to `target` (raises what the receiver raised)."""
    sender = make_sender("shm", "agent", 1 << 20)
    receiver = make_receiver("shm")
    out: dict[str, Any] = {}

    def receive() -> None:
        try:
            out["report"] = receiver.receive(manifest, target)
        except Exception as e:  # re-raised in the caller's thread
            out["error"] = e

    try:
        manifest = sender.publish(1, tensors)
        t = threading.Thread(target=receive)
        t.start()
        t.join(60)
        sender.wait()
    finally:
        sender.close()
        receiver.close()
    if "error" in out:
        raise out["error"]
    assert out["report"].applied


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_published_weights_load_into_a_fresh_hugging_face_model(
    gloo: None, hf_policy: Callable[[Path, int], Policy], tiny_qwen2_dir: Path, stage: int
) -> None:
    # Loaded before the trainer: under ZeRO-3 transformers partitions whatever loads while the
    # trainer's DeepSpeed config is alive, and an engine loads in its own process, unpartitioned.
    fresh = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    want = {n: tuple(p.shape) for n, p in fresh.named_parameters()}
    with torch.no_grad():
        initial = fresh(IDS).logits
    built = build_trainer(hf_policy(tiny_qwen2_dir, stage), seed=1, cuda=False, device=CPU, total_steps=2)
    logits = built.engine(IDS).logits.float()
    built.engine.backward(logits.logsumexp(-1).mean())
    built.engine.step()
    published = published_tensors(built.engine.module, zero_gather(stage))

    assert {n: tuple(t.shape) for n, t in published.items()} == want
    assert "lm_head.weight" not in published and not any("rotary" in n for n in published)
    _transfer(published, TensorTarget.from_module(fresh))
    with torch.no_grad():
        served = fresh(IDS).logits
        trained = built.engine(IDS).logits
    torch.testing.assert_close(served, trained)
    assert not torch.equal(served, initial)  # the step changed the weights, and they arrived
    if stage == 3:
        _check_bucket_gathers(built.engine.module, published)


def _check_bucket_gathers(module: torch.nn.Module, published: dict[str, torch.Tensor]) -> None:
    """ZeRO-3: parameters are gathered a bucket at a time, each parameter once, to the same values."""
    gather = zero_gather(3)
    assert gather is not None
    bucket_bytes = 64 << 10
    gathered: list[int] = []

    @contextlib.contextmanager
    def recording(params: list[torch.nn.Parameter]) -> Iterator[None]:
        with gather(params):
            assert all(p.numel() == getattr(p, "ds_numel", -1) for p in params)  # the bucket is whole inside
            gathered.append(sum(p.numel() * p.element_size() for p in params))
            yield

    bucketed = published_tensors(module, recording, bucket_bytes=bucket_bytes)
    assert len(gathered) > 3
    largest = max(t.numel() * t.element_size() for t in published.values())
    assert all(b <= max(bucket_bytes, largest) for b in gathered)
    assert sum(gathered) == sum(t.numel() * t.element_size() for t in published.values())
    assert published_tensors(module, gather, keep=False) == {}
    assert bucketed.keys() == published.keys()
    for name, t in bucketed.items():
        assert torch.equal(t, published[name]), name


def test_a_buffer_is_not_accepted_by_an_engine_target(tiny_qwen2_dir: Path) -> None:
    """A state dict plus buffers (a tied head under its own name, rotary inv_freq) is refused: the
    published names must be exactly the engine's parameters."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    with_buffers = {**{n: p.detach() for n, p in model.named_parameters()}, **dict(model.named_buffers())}
    assert len(with_buffers) > len(dict(model.named_parameters()))
    fresh = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    with pytest.raises(WeightMismatchError, match="rotary"):
        _transfer(with_buffers, TensorTarget.from_module(fresh))
