"""A real model's layout through every transport: a Qwen2's 290 parameters (q/k/v biases, norms,
projections, tied embeddings; names and shapes from `transformers` itself), and the per-layout caches
that keep the per-sync cost of hundreds of tensors down (layouts, manifest encoding, copy plans, views)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from weights_harness import bit_equal, make_pair, random_tensors, sync

from polyrl_runtime.weights import SyncReport, TensorTarget, WeightManifest
from polyrl_runtime.weights.buckets import BucketLayout, CopyPlan, layout_for, plan_copies, run_copies
from polyrl_runtime.weights.staging import ALIGN

ALL = ["objectstore", "shm", "collective"]


def qwen2_specs() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every parameter of a 24-layer Qwen2 (2 KV heads, tied embeddings) at hidden size 32, in bf16."""
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    return {name: (tuple(p.shape), torch.bfloat16) for name, p in model.named_parameters()}


SPECS = qwen2_specs()


def _relay(manifest: WeightManifest) -> WeightManifest:
    # The layout crosses processes by pickling (the handle of objectstore holds Ray references, which
    # only Ray's own serialisation may carry).
    layout: BucketLayout = pickle.loads(pickle.dumps(manifest.layout))
    return dataclasses.replace(manifest, layout=layout)


@pytest.fixture(params=ALL)
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "objectstore":
        request.getfixturevalue("ray_session")
    return str(request.param)


def test_the_layout_is_a_real_models() -> None:
    assert len(SPECS) == 290
    assert "model.layers.23.self_attn.k_proj.bias" in SPECS
    assert "model.layers.0.post_attention_layernorm.weight" in SPECS
    assert "lm_head.weight" not in SPECS  # tied: published once, as the embedding


@pytest.mark.parametrize("swappable", [False, True], ids=["in_place", "swap"])
@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 20])
def test_real_layout_round_trips_exactly_across_versions(
    transport: str, bucket_bytes: int, swappable: bool
) -> None:
    """Three versions: the first, one written in place into the same tensors (every cache keyed on
    their storage is hit and must read the new bytes), and one in new tensors (every cache misses)."""
    tensors = random_tensors(SPECS, seed=0)
    sender, (receiver,) = make_pair(transport, 1, bucket_bytes)
    target = TensorTarget({k: torch.zeros_like(v) for k, v in tensors.items()}, swappable=swappable)
    try:
        for version in range(3):
            if version == 1:
                for name, t in random_tensors(SPECS, seed=1).items():
                    tensors[name].copy_(t)
            elif version == 2:
                tensors = random_tensors(SPECS, seed=2)
            (report,) = sync(sender, [receiver], [target], version, tensors, relay=_relay)
            assert isinstance(report, SyncReport), report
            assert report.applied and report.num_tensors == 290
            assert target.version == version
            own = target.named_tensors()
            bad = [name for name, t in tensors.items() if not bit_equal(own[name], t)]
            assert not bad, f"{transport} v{version}: {len(bad)} tensors differ, first {bad[0]}"
    finally:
        sender.close()
        receiver.close()


def test_layout_for_is_one_object_while_names_shapes_and_dtypes_hold() -> None:
    tensors = random_tensors(SPECS)
    layout = layout_for(tensors, 4096, align=ALIGN)
    assert layout_for(dict(tensors), 4096, align=ALIGN) is layout
    assert layout_for(tensors, 8192, align=ALIGN) is not layout
    reshaped = {**tensors, "model.norm.weight": torch.zeros(31, dtype=torch.bfloat16)}
    assert layout_for(reshaped, 4096, align=ALIGN).specs[-1].shape == (31,)
    retyped = {**tensors, "model.norm.weight": torch.zeros(32, dtype=torch.float32)}
    assert layout_for(retyped, 4096, align=ALIGN).specs[-1].dtype == torch.float32


def test_a_layout_crosses_processes_as_one_blob_decoded_once() -> None:
    layout = layout_for(random_tensors(SPECS), 4096, align=ALIGN)
    wire = pickle.dumps(layout)
    assert pickle.dumps(layout) == wire  # encoded once per layout object
    first = pickle.loads(wire)
    assert first == layout and first is not layout
    assert first.buckets == layout.buckets and first.total_bytes == layout.total_bytes
    assert pickle.loads(wire) is first  # a receiver decodes a layout it has seen once
    assert pickle.loads(pickle.dumps(first)) is first  # and relays it without encoding it again
    other = pickle.loads(pickle.dumps(layout_for(random_tensors(SPECS), 8192, align=ALIGN)))
    assert other.bucket_bytes != first.bucket_bytes


def test_a_copy_plan_split_over_threads_copies_exactly_and_can_be_rerun() -> None:
    src = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (3 << 20, 7, 1, 5 << 20, 64)]
    dst = [torch.zeros_like(s) for s in src]
    plan = plan_copies(list(zip(dst, src, strict=True)), threads=2)
    assert isinstance(plan, CopyPlan) and len(plan.groups) == 2
    for _ in range(2):
        run_copies(plan)
        assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
        for s in src:
            s.random_(0, 256)  # in place: the plan's views read the new bytes on the next run
