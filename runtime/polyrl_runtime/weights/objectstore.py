"""`objectstore` transport: each bucket is one object in Ray's object store (works across nodes).

A bucket is put as a list of numpy uint8 arrays, which Ray serialises out of band and lays back to
back in one plasma object: the put is the only copy on the sender, and a same-node reader maps it
with none. What the list holds is chosen per segment of the bucket by size:

- a segment of at least `PACK_BELOW` bytes is a numpy view of the tensor's own bytes (no copy before
  the put; Ray copies large buffers in parallel);
- the smaller ones (a real model's norms, biases and small projections: most of its tensors, few of
  its bytes) are packed into *one* array at `ALIGN`-aligned offsets, so they cost Ray one buffer to
  serialise and one to map instead of one each. Packing copies their bytes once more; below the
  threshold that copy costs less than a buffer's serialisation, above it more.

A bucket of many mid-sized arrays (a real layout's projections: a few hundred KiB to a few MiB each)
is put as up to `default_copy_threads()` objects at once, each a run of its arrays of about equal
bytes: `ray.put` releases the GIL while it copies, and Ray parallelises the copy of a large buffer
only, so those would otherwise be copied on one core while a few large tensors use several.

Where each segment lies (which array, which offset) is a pure function of the manifest's layout
(`object_plan`), so the objects carry bytes only and every receiver finds the names, dtypes, shapes
and offsets in the layout it already holds. Torch tensors would go through the much slower torch
pickling path unless `RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1`; numpy arrays need no such switch. The
manifest carries the object references; the sender keeps the latest version's references alive so a
late-joining engine can still fetch it, and drops them when the next version is published.

An engine whose target may swap its tensors (every `TensorTarget.from_module` on the CPU: the torch
engine) serves straight from the fetched objects: each tensor becomes a typed view of the read-only
plasma buffer that holds it, so applying a version copies nothing and pauses the engine for O(1) per
tensor (shm and collective do the same with their staging buffers). The views keep those objects
pinned in the store until the next version replaces them; engines of the policy on one node share
them. A tensor the layout split across two buckets, or one whose bytes are not aligned for its
dtype, is assembled into a private tensor instead. Targets that must be written in place (and GPU
engines) get the copy.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import ray
import structlog
import torch

from polyrl_runtime.weights.api import (
    DeltaLink,
    SyncReport,
    WeightManifest,
    WeightReceiver,
    WeightSender,
    WeightTarget,
    check_manifest,
    make_report,
    swappable,
)
from polyrl_runtime.weights.buckets import (
    PARALLEL_MIN_BYTES,
    BucketLayout,
    CopyPlan,
    Pair,
    byte_view,
    copy_pairs,
    copy_pool,
    default_copy_threads,
    layout_for,
    ordered_tensors,
    plan_copies,
    run_copies,
)
from polyrl_runtime.weights.delta import DeltaError
from polyrl_runtime.weights.delta_chain import DeltaChain, chain_from, log_rejected, receive_links
from polyrl_runtime.weights.staging import ALIGN

log = structlog.get_logger(__name__)

# Segments smaller than this are packed into one array per bucket. Measured on a 2-core host: Ray
# spends a few microseconds per buffer on each side, about what copying 32-64 KiB costs.
PACK_BELOW = 64 << 10

_Bytes = np.ndarray[Any, np.dtype[np.uint8]]
T = TypeVar("T")


@dataclass(frozen=True)
class Piece:
    """`nbytes` bytes of tensor `tensor` from its byte `src_offset`, a segment of bucket `bucket`,
    lie at `offset` of array `array` of that bucket's objects (array 0 is the packed one)."""

    tensor: int
    bucket: int
    array: int
    offset: int
    src_offset: int
    nbytes: int


@dataclass(frozen=True)
class ObjectPlan:
    """Where every byte of a layout lies in its objects; a pure function of the layout."""

    pieces: tuple[tuple[Piece, ...], ...]  # per bucket, in segment order
    pack_bytes: tuple[int, ...]  # per bucket: size of its packed array
    by_tensor: tuple[tuple[Piece, ...], ...]  # per tensor of the layout, in byte order


def build_object_plan(layout: BucketLayout, pack_below: int = PACK_BELOW) -> ObjectPlan:
    per_bucket: list[tuple[Piece, ...]] = []
    sizes: list[int] = []
    by_tensor: list[list[Piece]] = [[] for _ in layout.specs]
    for bucket in layout.buckets:
        packed, arrays, pieces = 0, 1, []
        for seg in bucket.segments:
            if seg.nbytes < pack_below:
                piece = Piece(seg.tensor, bucket.index, 0, packed, seg.src_offset, seg.nbytes)
                packed += -(-seg.nbytes // ALIGN) * ALIGN
            else:
                piece = Piece(seg.tensor, bucket.index, arrays, 0, seg.src_offset, seg.nbytes)
                arrays += 1
            pieces.append(piece)
            by_tensor[seg.tensor].append(piece)
        per_bucket.append(tuple(pieces))
        sizes.append(packed)
    return ObjectPlan(tuple(per_bucket), tuple(sizes), tuple(tuple(p) for p in by_tensor))


# Plans by layout digest (hashing a layout would cost per tensor); receivers run on several threads.
_CACHE: OrderedDict[tuple[str, bytes], Any] = OrderedDict()
_CACHE_MAX = 16
_CACHE_LOCK = threading.Lock()


def _cached(kind: str, layout: BucketLayout, build: Callable[[BucketLayout], T]) -> T:
    key = (kind, layout.wire[0])
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            found: T = _CACHE[key]
            return found
    value = build(layout)
    with _CACHE_LOCK:
        _CACHE[key] = value
        while len(_CACHE) > _CACHE_MAX:
            _CACHE.popitem(last=False)
    return value


def object_plan(layout: BucketLayout) -> ObjectPlan:
    """The plan of `layout`, built once per layout."""
    return _cached("objects", layout, build_object_plan)


def split_parts(arrays: list[_Bytes], parts: int) -> list[list[_Bytes]]:
    """`arrays` cut into at most `parts` runs of about equal bytes, in order, none empty. One run when
    the arrays are few and large (Ray copies each of those on several threads already: more puts at
    once would only compete for the same cores) or the bucket too small to be worth it."""
    total = sum(a.nbytes for a in arrays)
    if parts <= 1 or total < PARALLEL_MIN_BYTES or total >= PARALLEL_MIN_BYTES * len(arrays):
        return [arrays]
    out: list[list[_Bytes]] = [[]]
    done = 0
    for a in arrays:
        # Start the next run once this one holds its share (the last run takes what is left).
        if out[-1] and len(out) < parts and done >= total * len(out) / parts:
            out.append([])
        out[-1].append(a)
        done += a.nbytes
    return out


def _host_bytes(t: torch.Tensor) -> _Bytes:
    b = byte_view(t)
    if b.device.type != "cpu":
        # GPU weights are staged through host memory; the object store is host memory.
        b = b.cpu()
    arr: _Bytes = b.numpy()
    return arr


class ObjectStoreSender(WeightSender):
    """Puts each version whole; with `deltas` > 0 also the bit-exact deltas from the previous version,
    and lists those of the last `deltas` versions in each manifest (weights/delta_chain.py)."""

    transport: ClassVar[str] = "objectstore"

    def __init__(self, policy: str, bucket_bytes: int, deltas: int = 0) -> None:
        super().__init__(policy, bucket_bytes)
        self._chain = DeltaChain(deltas) if deltas > 0 else None
        self._refs: list[Any] = []
        self._pack: torch.Tensor | None = None
        self._key: tuple[object, ...] | None = None
        self._objects: list[tuple[CopyPlan, list[_Bytes]]] = []

    def _pack_buffer(self, plan: ObjectPlan) -> torch.Tensor:
        need = max(plan.pack_bytes, default=0)
        if self._pack is None or self._pack.numel() < need:
            self._pack = torch.empty(need, dtype=torch.uint8)
        return self._pack

    def _bucket_objects(
        self, layout: BucketLayout, ordered: list[torch.Tensor]
    ) -> list[tuple[CopyPlan, list[_Bytes]]]:
        """Per bucket, the copies that pack its small segments and numpy views of its large ones.
        Host tensors are the trainer's own storage, updated in place, so this is built once per layout
        and storage (slicing hundreds of tensors costs a few percent of a sync); device tensors are
        staged through host memory anew each time."""
        plan = object_plan(layout)
        pack = self._pack_buffer(plan)
        host = all(t.device.type == "cpu" for t in ordered)
        key = (layout, pack.data_ptr(), tuple(t.data_ptr() for t in ordered)) if host else None
        if key is not None and key == self._key:
            return self._objects
        objects = []
        for pieces in plan.pieces:
            pairs: list[Pair] = []
            large: list[_Bytes] = []
            for p in pieces:
                src = byte_view(ordered[p.tensor])[p.src_offset : p.src_offset + p.nbytes]
                if p.array == 0:
                    pairs.append((pack[p.offset : p.offset + p.nbytes], src))
                else:
                    large.append(_host_bytes(src))
            objects.append((plan_copies(pairs), large))
        self._key, self._objects = key, (objects if host else [])
        return objects

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightManifest:
        self._check_version(version)
        layout = layout_for(tensors, self.bucket_bytes)
        ordered = ordered_tensors(layout, tensors)
        plan = object_plan(layout)
        refs: list[tuple[Any, ...]] = []
        threads = default_copy_threads()
        for (copies, large), packed in zip(
            self._bucket_objects(layout, ordered), plan.pack_bytes, strict=True
        ):
            assert self._pack is not None
            run_copies(copies)
            parts = split_parts([self._pack[:packed].numpy(), *large], threads)
            # ray.put copies every array into the store before it returns: the pack buffer is free again.
            put = [ray.put(parts[0])] if len(parts) == 1 else list(copy_pool(len(parts)).map(ray.put, parts))
            refs.append(tuple(put))
        # Replacing the list drops our references to the previous version; engines still reading it
        # hold their own (borrowed) references through the manifest, so Ray frees it after them.
        self._refs = refs
        links = self._chain.extend(version, tensors, ray.put) if self._chain is not None else ()
        self.latest = WeightManifest(
            self.policy, version, self.transport, layout, handle=tuple(refs), deltas=links
        )
        log.debug("weights.published", policy=self.policy, version=version, buckets=len(refs))
        return self.latest

    def close(self) -> None:
        self._refs = []
        self._pack, self._key, self._objects = None, None, []
        if self._chain is not None:
            self._chain.clear()
        self.latest = None


class ObjectStoreReceiver(WeightReceiver):
    transport: ClassVar[str] = "objectstore"

    def receive(self, manifest: WeightManifest, target: WeightTarget) -> SyncReport:
        start = time.perf_counter()
        check_manifest(manifest, target)
        layout = manifest.layout
        if manifest.version == target.version:
            return make_report(manifest, start, 0.0, applied=False)
        links = chain_from(manifest, target.version)
        if links:
            try:
                return self._receive_deltas(manifest, links, target, start)
            except DeltaError as e:  # this update only: the whole version follows
                log_rejected(manifest, target.version, e)
        # Fetch every bucket before touching the engine: a failed fetch leaves the old version intact.
        handle: tuple[tuple[Any, ...], ...] = manifest.handle
        fetched: list[list[_Bytes]] = ray.get([ref for bucket in handle for ref in bucket])
        with warnings.catch_warnings():
            # Plasma buffers are read-only; we only ever read from these tensors.
            warnings.simplefilter("ignore", UserWarning)
            parts = iter(fetched)
            arrays = [[torch.from_numpy(a) for _ in bucket for a in next(parts)] for bucket in handle]
        plan = object_plan(layout)
        if _serves_from_store(target):
            new = _tensors_of(layout, plan, arrays)
            pause_start = time.perf_counter()
            with target.paused(manifest.version):
                target.swap(new)  # type: ignore[attr-defined]  # swappable() checked it is a TensorTarget
        else:
            own = target.named_tensors()
            ordered = [own[s.name] for s in layout.specs]
            pairs = [
                (
                    byte_view(ordered[p.tensor])[p.src_offset : p.src_offset + p.nbytes],
                    arrays[p.bucket][p.array][p.offset : p.offset + p.nbytes],
                )
                for pieces in plan.pieces
                for p in pieces
            ]
            pause_start = time.perf_counter()
            with target.paused(manifest.version):
                copy_pairs(pairs)
        pause = time.perf_counter() - pause_start
        return make_report(manifest, start, pause, applied=True)

    @staticmethod
    def _receive_deltas(
        manifest: WeightManifest, links: list[DeltaLink], target: WeightTarget, start: float
    ) -> SyncReport:
        """Apply the chain from the engine's version: every tensor checked before any is served."""
        data: list[bytes] = ray.get([link.handle for link in links])
        return receive_links(manifest, data, target, start, sum(link.nbytes for link in links))


def _serves_from_store(target: WeightTarget) -> bool:
    return swappable(target) and all(t.device.type == "cpu" for t in target.named_tensors().values())


@dataclass(frozen=True)
class ViewPlan:
    """How a swapping receiver builds a version's tensors, a pure function of the layout: the typed
    arrays to view (bucket, array, dtype), then per tensor held whole at an aligned offset (name, which
    typed array, element offset, shape, strides), and the tensors to assemble from their pieces."""

    keys: tuple[tuple[int, int, torch.dtype], ...]
    views: tuple[tuple[str, int, int, tuple[int, ...], tuple[int, ...]], ...]
    assembled: tuple[int, ...]


def build_view_plan(layout: BucketLayout, plan: ObjectPlan) -> ViewPlan:
    keys: dict[tuple[int, int, torch.dtype], int] = {}
    views = []
    assembled = []
    for i, (spec, pieces) in enumerate(zip(layout.specs, plan.by_tensor, strict=True)):
        size = spec.dtype.itemsize
        if len(pieces) != 1 or pieces[0].offset % size:
            assembled.append(i)
            continue
        p = pieces[0]
        k = keys.setdefault((p.bucket, p.array, spec.dtype), len(keys))
        strides = tuple(torch.empty(spec.shape, device="meta").stride())
        views.append((spec.name, k, p.offset // size, spec.shape, strides))
    return ViewPlan(tuple(keys), tuple(views), tuple(assembled))


def view_plan(layout: BucketLayout) -> ViewPlan:
    return _cached("views", layout, lambda lay: build_view_plan(lay, object_plan(lay)))


def _typed(array: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`array` (uint8) as `dtype`, or None where its start is not aligned for it."""
    size = dtype.itemsize
    if array.data_ptr() % size:
        return None
    return array[: array.numel() - array.numel() % size].view(dtype)


def _tensors_of(
    layout: BucketLayout, plan: ObjectPlan, arrays: list[list[torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Each tensor of the version: a typed view of the fetched array that holds it whole, else (split
    across buckets, misaligned, or no bytes) a private tensor assembled from its pieces.

    Hundreds of tensors: one strided view each, of a typed view of its array made once per array and
    dtype; everything else is planned once per layout (`view_plan`)."""
    vp = view_plan(layout)
    typed = [_typed(arrays[b][a], dtype) for b, a, dtype in vp.keys]
    out: dict[str, torch.Tensor] = {}
    misaligned = []
    for name, k, offset, shape, strides in vp.views:
        view = typed[k]
        if view is None:
            misaligned.append(name)
        else:
            out[name] = view.as_strided(shape, strides, offset)
    index = {s.name: i for i, s in enumerate(layout.specs)} if misaligned else {}
    for i in (*vp.assembled, *(index[n] for n in misaligned)):
        spec = layout.specs[i]
        t = torch.empty(spec.shape, dtype=spec.dtype)
        flat = byte_view(t)
        for p in plan.by_tensor[i]:
            flat[p.src_offset : p.src_offset + p.nbytes].copy_(
                arrays[p.bucket][p.array][p.offset : p.offset + p.nbytes]
            )
        out[spec.name] = t
    return out
