"""Flatten named tensors into fixed-size byte buckets and back, for any dtype (bf16 included).

All tensors of a version are laid back to back in one flat byte space (in publish order; no padding
unless `align` asks for it: bytes are copied through uint8 views, so copies need no alignment, but a
receiver that serves straight from its flat staging buffer needs each tensor's start aligned for a dtype
view, see `staging.py`). That space is cut into buckets of
at most `bucket_bytes`; a tensor larger than a bucket spans several, so a bucket never exceeds its
size and memory for staging stays bounded by it. The layout is a pure function of the specs and the
bucket size, so sender and receivers agree on it from the manifest alone.

A model has hundreds of tensors, so nothing here may cost Python work per tensor per sync where it can
be paid once per layout: `layout_for` returns the same layout object while the names, shapes and dtypes
stay the same, and a layout crosses processes as one opaque blob plus its digest (`__reduce__`); a
process that has seen that digest reuses its decoded layout, so after the first sync the manifest costs
a small copy of bytes, not hundreds of objects, on the trainer, the driver and every engine.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache
from typing import Any

import torch

# Copies smaller than this are not split across threads: thread hand-off costs more than it saves.
PARALLEL_MIN_BYTES = 4 << 20


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(t.shape), t.dtype)


@dataclass(frozen=True)
class Segment:
    """`nbytes` bytes of tensor `tensor` starting at its byte `src_offset`, stored at flat `flat_offset`."""

    tensor: int
    src_offset: int
    flat_offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    index: int
    offset: int
    nbytes: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class BucketLayout:
    specs: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int

    @cached_property
    def total_bytes(self) -> int:
        """Bytes of the flat space (the tensors' bytes plus any alignment padding)."""
        return sum(b.nbytes for b in self.buckets)

    @cached_property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @cached_property
    def wire(self) -> tuple[bytes, bytes]:
        """(digest, blob): the layout as plain tuples, pickled once per layout object."""
        plain = (
            self.bucket_bytes,
            tuple((s.name, s.shape, s.dtype) for s in self.specs),
            tuple(
                (
                    b.index,
                    b.offset,
                    b.nbytes,
                    tuple((g.tensor, g.src_offset, g.flat_offset, g.nbytes) for g in b.segments),
                )
                for b in self.buckets
            ),
        )
        blob = pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)
        return hashlib.blake2b(blob, digest_size=16).digest(), blob

    def __reduce__(self) -> tuple[Any, tuple[bytes, bytes]]:
        return (_decode_layout, self.wire)


# Decoded layouts by digest: a receiver (and the driver relaying manifests) decodes a layout once.
_DECODED: OrderedDict[bytes, BucketLayout] = OrderedDict()
_DECODED_MAX = 16
_DECODED_LOCK = threading.Lock()  # actors decode manifests on several threads


def _decode_layout(digest: bytes, blob: bytes) -> BucketLayout:
    with _DECODED_LOCK:
        layout = _DECODED.get(digest)
        if layout is not None:
            _DECODED.move_to_end(digest)
            return layout
    bucket_bytes, specs, buckets = pickle.loads(blob)
    layout = BucketLayout(
        tuple(TensorSpec(n, tuple(shape), dtype) for n, shape, dtype in specs),
        tuple(Bucket(i, off, nb, tuple(Segment(*g) for g in segs)) for i, off, nb, segs in buckets),
        bucket_bytes,
    )
    layout.__dict__["wire"] = (digest, blob)  # relaying it again costs no encoding
    with _DECODED_LOCK:
        layout = _DECODED.setdefault(digest, layout)
        while len(_DECODED) > _DECODED_MAX:
            _DECODED.popitem(last=False)
    return layout


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int, align: int = 1) -> BucketLayout:
    """Cut the flat byte space of `specs` into buckets of at most `bucket_bytes`.

    With `align` > 1 every tensor starts at a multiple of `align` (padding bytes belong to a bucket but
    to no segment) and buckets are a multiple of `align` long, so a tensor's start never needs padding
    past its bucket's end.
    """
    if bucket_bytes <= 0 or align <= 0:
        raise ValueError("bucket_bytes and align must be positive")
    if align > 1:
        bucket_bytes = max(align, bucket_bytes - bucket_bytes % align)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    buckets: list[Bucket] = []
    current: list[Segment] = []
    bucket_start = 0
    flat = 0
    for i, spec in enumerate(specs):
        done = 0
        size = spec.nbytes
        if size and flat % align:
            flat += align - flat % align
            if flat - bucket_start == bucket_bytes:
                buckets.append(Bucket(len(buckets), bucket_start, flat - bucket_start, tuple(current)))
                current, bucket_start = [], flat
        while done < size:
            room = bucket_bytes - (flat - bucket_start)
            take = min(room, size - done)
            current.append(Segment(i, done, flat, take))
            done += take
            flat += take
            if flat - bucket_start == bucket_bytes:
                buckets.append(Bucket(len(buckets), bucket_start, flat - bucket_start, tuple(current)))
                current, bucket_start = [], flat
    if flat > bucket_start:
        buckets.append(Bucket(len(buckets), bucket_start, flat - bucket_start, tuple(current)))
    return BucketLayout(tuple(specs), tuple(buckets), bucket_bytes)


def tensor_offsets(layout: BucketLayout) -> list[int]:
    """The flat offset where each tensor (in layout order) starts; -1 for a tensor of no bytes."""
    out = [-1] * len(layout.specs)
    for b in layout.buckets:
        for seg in b.segments:
            if seg.src_offset == 0:
                out[seg.tensor] = seg.flat_offset
    return out


def layout_for(tensors: Mapping[str, torch.Tensor], bucket_bytes: int, align: int = 1) -> BucketLayout:
    """The layout of `tensors`; the same object while names, shapes and dtypes are unchanged, so
    everything keyed on it (copy plans, typed views, the manifest's encoding) is reused."""
    key = (tuple((n, t.shape, t.dtype) for n, t in tensors.items()), bucket_bytes, align)
    return _cached_layout(key)


@lru_cache(maxsize=8)
def _cached_layout(key: tuple[tuple[tuple[str, torch.Size, torch.dtype], ...], int, int]) -> BucketLayout:
    specs, bucket_bytes, align = key
    return plan_buckets(
        [TensorSpec(n, tuple(shape), dtype) for n, shape, dtype in specs], bucket_bytes, align
    )


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor's bytes (no copy; works for bf16, bool, 0-d, empty)."""
    if not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    return t.reshape(-1).view(torch.uint8)


@cache
def copy_pool(threads: int) -> ThreadPoolExecutor:
    """A pool of `threads` threads for host copies (torch copies and `ray.put` release the GIL)."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="polyrl-copy")


def default_copy_threads() -> int:
    """Threads for host memcpy: torch's copy_ releases the GIL, so two threads nearly double throughput."""
    env = os.environ.get("POLYRL_COPY_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(4, os.cpu_count() or 1))


Pair = tuple[torch.Tensor, torch.Tensor]  # (dst, src)


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """Copies cut into one group per thread (host) or one group run in order (devices): a pure
    function of the pairs, so callers that copy the same tensors every sync build it once."""

    groups: tuple[tuple[Pair, ...], ...]
    host: bool


def plan_copies(pairs: Sequence[Pair], threads: int | None = None) -> CopyPlan:
    """Large host copies split into an even share of the bytes per thread (large tensors split,
    small ones grouped: a pool task per tensor would cost more in hand-offs than the copies)."""
    threads = default_copy_threads() if threads is None else threads
    total = sum(d.numel() for d, _ in pairs)
    host = all(d.device.type == "cpu" and s.device.type == "cpu" for d, s in pairs)
    if not host or threads <= 1 or total < PARALLEL_MIN_BYTES:
        return CopyPlan((tuple(pairs),), host)
    share = -(-total // threads)
    groups: list[list[Pair]] = [[]]
    room = share
    for d, s in pairs:
        start, n = 0, d.numel()
        while start < n:
            if room == 0:
                groups.append([])
                room = share
            take = min(room, n - start)
            groups[-1].append((d[start : start + take], s[start : start + take]))
            start += take
            room -= take
    return CopyPlan(tuple(tuple(g) for g in groups), host)


def run_copies(plan: CopyPlan) -> None:
    if not plan.host:
        for d, s in plan.groups[0]:
            d.copy_(s)
    elif len(plan.groups) == 1:
        _copy_all(plan.groups[0])
    else:
        list(copy_pool(len(plan.groups)).map(_copy_all, plan.groups))


def copy_pairs(pairs: Sequence[Pair], threads: int | None = None) -> None:
    """`dst.copy_(src)` for each pair, splitting large host copies into chunks run on a thread pool."""
    run_copies(plan_copies(pairs, threads))


def _copy_all(pairs: Sequence[Pair]) -> None:
    """Host copies in one call (`_foreach_copy_`, which releases the GIL): a Python `copy_` per
    tensor costs microseconds each, a tenth of a sync at a real model's few hundred tensors."""
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


def bucket_pairs(
    layout: BucketLayout,
    bucket: Bucket,
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    *,
    into_flat: bool,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst, src) uint8 pairs that move `bucket` between `tensors` and the flat byte buffer `flat`.

    `flat` holds the whole version and is indexed by flat offsets.
    """
    pairs = []
    for seg in bucket.segments:
        tb = byte_view(tensors[seg.tensor])[seg.src_offset : seg.src_offset + seg.nbytes]
        fb = flat[seg.flat_offset : seg.flat_offset + seg.nbytes]
        pairs.append((fb, tb) if into_flat else (tb, fb))
    return pairs


class PairCache:
    """Remembers the copy pairs (and their `CopyPlan`) of the last syncs: with hundreds of tensors,
    building a slice per tensor and side costs a sizeable part of copying them. Valid while the layout,
    the flat buffer and the tensors' storage are unchanged (trainers update parameters in place; an
    engine that swaps between two staging buffers alternates between two keys, hence room for two)."""

    def __init__(self, entries: int = 2) -> None:
        self._entries = entries
        self._cache: list[tuple[tuple[object, ...], list[list[Pair]], list[CopyPlan]]] = []

    def _entry(
        self, layout: BucketLayout, tensors: Sequence[torch.Tensor], flat: torch.Tensor, into_flat: bool
    ) -> tuple[tuple[object, ...], list[list[Pair]], list[CopyPlan]]:
        key = (layout, flat.data_ptr(), flat.numel(), into_flat, tuple(t.data_ptr() for t in tensors))
        for entry in self._cache:
            if entry[0] == key:
                return entry
        lists = [bucket_pairs(layout, b, tensors, flat, into_flat=into_flat) for b in layout.buckets]
        entry = (key, lists, [])
        self._cache = [*self._cache, entry][-self._entries :]
        return entry

    def per_bucket(
        self, layout: BucketLayout, tensors: Sequence[torch.Tensor], flat: torch.Tensor, *, into_flat: bool
    ) -> list[list[Pair]]:
        return self._entry(layout, tensors, flat, into_flat)[1]

    def pairs(
        self, layout: BucketLayout, tensors: Sequence[torch.Tensor], flat: torch.Tensor, *, into_flat: bool
    ) -> list[Pair]:
        return [p for b in self.per_bucket(layout, tensors, flat, into_flat=into_flat) for p in b]

    def plan(
        self, layout: BucketLayout, tensors: Sequence[torch.Tensor], flat: torch.Tensor, *, into_flat: bool
    ) -> CopyPlan:
        """The copies of the whole version, planned once per entry."""
        _, lists, plans = self._entry(layout, tensors, flat, into_flat)
        if not plans:
            plans.append(plan_copies([p for b in lists for p in b]))
        return plans[0]


def ordered_tensors(layout: BucketLayout, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in layout order, made contiguous (a copy only for non-contiguous inputs)."""
    return [tensors[s.name].contiguous() for s in layout.specs]


def flatten(
    layout: BucketLayout, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """All tensors packed into one flat uint8 buffer of `layout.total_bytes` (reused when `out` is given)."""
    ordered = ordered_tensors(layout, tensors)
    device = ordered[0].device if ordered else torch.device("cpu")
    if out is None:
        out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    pairs = [p for b in layout.buckets for p in bucket_pairs(layout, b, ordered, out, into_flat=True)]
    copy_pairs(pairs)
    return out


def unflatten_into(layout: BucketLayout, flat: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy a flat buffer produced by `flatten` into existing tensors (same names, shapes, dtypes)."""
    ordered = [tensors[s.name] for s in layout.specs]
    pairs = [p for b in layout.buckets for p in bucket_pairs(layout, b, ordered, flat, into_flat=False)]
    copy_pairs(pairs)


def unflatten(layout: BucketLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """New tensors holding the contents of a flat buffer."""
    out = {s.name: torch.empty(s.shape, dtype=s.dtype, device=flat.device) for s in layout.specs}
    unflatten_into(layout, flat, out)
    return out
