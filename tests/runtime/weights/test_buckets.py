"""Bucket layout: every byte of every tensor lands in exactly one bucket slot; round trips are exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl_runtime.weights.buckets import TensorSpec, byte_view, flatten, layout_for, plan_buckets, unflatten
from polyrl_runtime.weights.collective_group import broadcast_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]

specs_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 9), max_size=3), st.sampled_from(DTYPES)), max_size=12
).map(lambda xs: [TensorSpec(f"t{i}", tuple(shape), dt) for i, (shape, dt) in enumerate(xs)])


@settings(max_examples=200, deadline=None)
@given(specs=specs_strategy, bucket_bytes=st.integers(1, 600))
def test_layout_covers_each_tensor_exactly_once(specs: list[TensorSpec], bucket_bytes: int) -> None:
    layout = plan_buckets(specs, bucket_bytes)
    total = sum(s.nbytes for s in specs)
    assert layout.total_bytes == total
    assert len(layout.buckets) == -(-total // bucket_bytes)
    flat_pos = 0
    covered = {i: 0 for i in range(len(specs))}
    for k, b in enumerate(layout.buckets):
        assert b.index == k and b.offset == flat_pos
        assert 0 < b.nbytes <= bucket_bytes
        assert sum(s.nbytes for s in b.segments) == b.nbytes
        for seg in b.segments:
            assert seg.flat_offset == flat_pos and seg.nbytes > 0
            assert seg.src_offset == covered[seg.tensor]  # in order, no gap, no overlap
            covered[seg.tensor] += seg.nbytes
            flat_pos += seg.nbytes
    assert covered == {i: s.nbytes for i, s in enumerate(specs)}
    # Every bucket but the last is full: the bucket count is the minimum possible.
    assert all(b.nbytes == bucket_bytes for b in layout.buckets[:-1])


@settings(max_examples=200, deadline=None)
@given(
    specs=specs_strategy,
    bucket_bytes=st.integers(1, 600),
    align=st.sampled_from([1, 8, 64]),
    direct_min=st.integers(1, 200),
)
def test_collective_broadcasts_cover_each_piece_once(
    specs: list[TensorSpec], bucket_bytes: int, align: int, direct_min: int
) -> None:
    """The collective's broadcasts: every piece of every tensor in exactly one, in flat order; large
    pieces alone (sent from the tensor), small ones grouped within one bucket (packed)."""
    layout = plan_buckets(specs, bucket_bytes, align)
    ops = broadcast_ops(layout, direct_min)
    assert [s for op in ops for s in op.segments] == [s for b in layout.buckets for s in b.segments]
    bucket_of = {s: b for b in layout.buckets for s in b.segments}
    end = 0
    for op in ops:
        first, last = op.segments[0], op.segments[-1]
        assert op.offset == first.flat_offset >= end  # in order, no overlap
        assert op.offset + op.nbytes == last.flat_offset + last.nbytes
        end = op.offset + op.nbytes
        if op.direct:
            assert len(op.segments) == 1 and first.nbytes >= direct_min
        else:
            assert all(s.nbytes < direct_min for s in op.segments)
            assert len({bucket_of[s].index for s in op.segments}) == 1
            assert op.nbytes <= layout.bucket_bytes


@settings(max_examples=60, deadline=None)
@given(specs=specs_strategy, bucket_bytes=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_flatten_unflatten_round_trip(specs: list[TensorSpec], bucket_bytes: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        s.name: torch.randint(0, 256, (s.nbytes,), dtype=torch.uint8, generator=g)
        .view(s.dtype)
        .reshape(s.shape)
        if s.nbytes
        else torch.empty(s.shape, dtype=s.dtype)
        for s in specs
    }
    layout = layout_for(tensors, bucket_bytes)
    back = unflatten(layout, flatten(layout, tensors))
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(byte_view(back[name]), byte_view(t))


def test_non_contiguous_sender_tensor_is_packed_by_value() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {"t": base.t()}  # a transposed view
    layout = layout_for(tensors, 7)
    back = unflatten(layout, flatten(layout, tensors))
    assert torch.equal(back["t"], base.t())


def test_large_copies_split_over_threads_stay_exact() -> None:
    # Above the threshold at which copy_pairs fans out to the thread pool.
    a = torch.randint(0, 256, (9 << 20,), dtype=torch.uint8)
    tensors = {"a": a, "b": torch.randn(3 << 20)}
    layout = layout_for(tensors, 5 << 20)
    back = unflatten(layout, flatten(layout, tensors))
    assert torch.equal(back["a"], a) and torch.equal(back["b"], tensors["b"])


def test_duplicate_names_and_bad_bucket_size_rejected() -> None:
    with pytest.raises(ValueError, match="unique"):
        plan_buckets([TensorSpec("a", (1,), torch.float32)] * 2, 10)
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([], 0)
