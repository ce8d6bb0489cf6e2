"""`objectstore` transport: each bucket is one object in Ray's object store (works across nodes).

Design for Ray's fast path: a bucket is put as a list of *numpy* uint8 views of its tensor segments.
Ray serialises numpy buffers out of band and lays them back to back in one plasma object, so the
flattening copy is the put itself (one copy on the sender, none for a same-node reader, and one into
the engine's parameters only for targets that cannot serve from the object, below). Torch tensors
would go through the much slower torch pickling path unless `RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1`;
numpy views need no such switch. The manifest carries the
object references; the sender keeps the latest version's references alive so a late-joining engine
can still fetch it, and drops them when the next version is published.

An engine whose target may swap its tensors (every `TensorTarget.from_module` on the CPU: the torch
engine) serves straight from the fetched object: each tensor becomes a typed view of the read-only
plasma buffer that holds it, so applying a version copies nothing and pauses the engine for O(1) per
tensor (shm and collective do the same with their staging buffers). The views keep that object
pinned in the store until the next version replaces them; engines of the policy on one node share
it. A tensor the layout split across two buckets, or one whose bytes are not aligned for its dtype,
is assembled into a private tensor instead. Targets that must be written in place (and GPU engines)
get the copy.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import ray
import structlog
import torch

from polyrl_runtime.weights.api import (
    SyncReport,
    WeightManifest,
    WeightReceiver,
    WeightSender,
    WeightTarget,
    check_manifest,
    make_report,
)
from polyrl_runtime.weights.buckets import BucketLayout, byte_view, copy_pairs, layout_for, ordered_tensors
from polyrl_runtime.weights.staging import swappable

log = structlog.get_logger(__name__)


_Bytes = np.ndarray[Any, np.dtype[np.uint8]]


def _host_bytes(t: torch.Tensor) -> _Bytes:
    b = byte_view(t)
    if b.device.type != "cpu":
        # GPU weights are staged through host memory; the object store is host memory.
        b = b.cpu()
    arr: _Bytes = b.numpy()
    return arr


class ObjectStoreSender(WeightSender):
    transport: ClassVar[str] = "objectstore"

    def __init__(self, policy: str, bucket_bytes: int) -> None:
        super().__init__(policy, bucket_bytes)
        self._refs: list[Any] = []
        self._views_key: tuple[object, ...] | None = None
        self._views: list[list[_Bytes]] = []

    def _bucket_views(self, layout: BucketLayout, ordered: list[torch.Tensor]) -> list[list[_Bytes]]:
        """Per bucket, numpy views of its segments. Host tensors are views of the trainer's own
        storage, which it updates in place, so they are built once per layout and storage (slicing
        hundreds of tensors costs a few percent of a sync); device tensors are staged anew each time."""
        host = all(t.device.type == "cpu" for t in ordered)
        key = (layout, tuple(t.data_ptr() for t in ordered)) if host else None
        if key is not None and key == self._views_key:
            return self._views
        arrays = [_host_bytes(t) for t in ordered]
        views = [
            [arrays[s.tensor][s.src_offset : s.src_offset + s.nbytes] for s in bucket.segments]
            for bucket in layout.buckets
        ]
        self._views_key, self._views = key, (views if host else [])
        return views

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightManifest:
        self._check_version(version)
        layout = layout_for(tensors, self.bucket_bytes)
        ordered = ordered_tensors(layout, tensors)
        refs = [ray.put(views) for views in self._bucket_views(layout, ordered)]
        # Replacing the list drops our references to the previous version; engines still reading it
        # hold their own (borrowed) references through the manifest, so Ray frees it after them.
        self._refs = refs
        self.latest = WeightManifest(self.policy, version, self.transport, layout, handle=tuple(refs))
        log.debug("weights.published", policy=self.policy, version=version, buckets=len(refs))
        return self.latest

    def close(self) -> None:
        self._refs = []
        self._views_key, self._views = None, []
        self.latest = None


class ObjectStoreReceiver(WeightReceiver):
    transport: ClassVar[str] = "objectstore"

    def receive(self, manifest: WeightManifest, target: WeightTarget) -> SyncReport:
        start = time.perf_counter()
        check_manifest(manifest, target)
        layout = manifest.layout
        if manifest.version == target.version:
            return make_report(manifest, start, 0.0, applied=False)
        # Fetch every bucket before touching the engine: a failed fetch leaves the old version intact.
        buckets: list[list[np.ndarray[Any, np.dtype[np.uint8]]]] = ray.get(list(manifest.handle))
        with warnings.catch_warnings():
            # Plasma buffers are read-only; we only ever read from these tensors.
            warnings.simplefilter("ignore", UserWarning)
            arrays = [[torch.from_numpy(a) for a in bucket] for bucket in buckets]
        if _serves_from_store(target):
            new = _tensors_of(layout, arrays)
            pause_start = time.perf_counter()
            with target.paused(manifest.version):
                target.swap(new)  # type: ignore[attr-defined]  # swappable() checked it is a TensorTarget
        else:
            own = target.named_tensors()
            ordered = [own[s.name] for s in layout.specs]
            pairs = []
            for bucket, segs in zip(layout.buckets, arrays, strict=True):
                for seg, src in zip(bucket.segments, segs, strict=True):
                    dst = byte_view(ordered[seg.tensor])[seg.src_offset : seg.src_offset + seg.nbytes]
                    pairs.append((dst, src))
            pause_start = time.perf_counter()
            with target.paused(manifest.version):
                copy_pairs(pairs)
        pause = time.perf_counter() - pause_start
        return make_report(manifest, start, pause, applied=True)


def _serves_from_store(target: WeightTarget) -> bool:
    return swappable(target) and all(t.device.type == "cpu" for t in target.named_tensors().values())


def _tensors_of(layout: BucketLayout, arrays: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each tensor of the version: a typed view of the one fetched buffer that holds it whole, else
    (split across buckets, misaligned, or no bytes) a private tensor assembled from its pieces."""
    pieces: list[list[tuple[int, torch.Tensor]]] = [[] for _ in layout.specs]
    for bucket, segs in zip(layout.buckets, arrays, strict=True):
        for seg, src in zip(bucket.segments, segs, strict=True):
            pieces[seg.tensor].append((seg.src_offset, src))
    out: dict[str, torch.Tensor] = {}
    for spec, parts in zip(layout.specs, pieces, strict=True):
        if len(parts) == 1 and parts[0][1].data_ptr() % spec.dtype.itemsize == 0:
            out[spec.name] = parts[0][1].view(spec.dtype).view(spec.shape)
            continue
        t = torch.empty(spec.shape, dtype=spec.dtype)
        flat = byte_view(t)
        for offset, src in parts:
            flat[offset : offset + src.numel()].copy_(src)
        out[spec.name] = t
    return out
