"""`shm` transport: trainer and engines on one host share a persistent memory-mapped segment.

The segment (a file in /dev/shm) is created once and reused by every sync while the model fits, since
mapping fresh shared memory per sync costs page faults on every byte (measured 3x slower). The sender
packs all buckets into it (host copies split over threads; torch releases the GIL) and stamps the
version into a header; engines copy from it straight into their parameters. An `flock` on the segment
orders the two: readers hold it shared while applying, the sender exclusive while packing, so a
publish never overwrites bytes an engine is reading. A reader that finds a newer version in the header
than its manifest names rejects the manifest and keeps its old weights (the newer manifest follows).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import structlog
import torch

from polyrl_runtime.weights.api import (
    SyncReport,
    WeightManifest,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightTarget,
    check_manifest,
    make_report,
)
from polyrl_runtime.weights.buckets import PairCache, copy_pairs, layout_for, ordered_tensors

log = structlog.get_logger(__name__)

_HEADER = 64  # bytes before the data: int64 version (-1 while being written)
_WRITING = -1


@dataclass(frozen=True)
class ShmHandle:
    path: str
    capacity: int  # data bytes after the header


def _shm_dir() -> str:
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else tempfile.gettempdir()


class _Mapping:
    """One mapped segment plus the descriptor its flock lives on."""

    def __init__(self, path: str, capacity: int, *, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            self.fd = os.open(path, flags, 0o600)
        except FileNotFoundError as e:
            raise WeightSyncError(
                f"shm segment {path} not found: the shm transport needs the engine on the trainer's host"
            ) from e
        if create:
            os.ftruncate(self.fd, _HEADER + capacity)
        self.path = path
        self.capacity = capacity
        self.buf = torch.from_file(path, shared=True, size=_HEADER + capacity, dtype=torch.uint8)
        self.data = self.buf[_HEADER:]
        self._version = self.buf[:8].view(torch.int64)

    @property
    def version(self) -> int:
        return int(self._version[0])

    @version.setter
    def version(self, v: int) -> None:
        self._version[0] = v

    def lock(self, exclusive: bool) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self.fd)


class ShmSender(WeightSender):
    transport: ClassVar[str] = "shm"

    def __init__(self, policy: str, bucket_bytes: int, directory: str | None = None) -> None:
        super().__init__(policy, bucket_bytes)
        self._dir = directory or _shm_dir()
        self._seg: _Mapping | None = None
        self._pairs = PairCache()

    def _segment(self, nbytes: int) -> _Mapping:
        if self._seg is not None and self._seg.capacity >= nbytes:
            return self._seg
        self._drop_segment()
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.policy)
        path = os.path.join(self._dir, f"polyrl-weights-{safe}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        # Round up so a model that grows slightly (or a different bucket size) reuses the segment.
        capacity = max(1, nbytes + nbytes // 16)
        self._seg = _Mapping(path, capacity, create=True)
        self._seg.version = _WRITING
        log.info("weights.shm.segment", policy=self.policy, path=path, capacity=capacity)
        return self._seg

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightManifest:
        self._check_version(version)
        layout = layout_for(tensors, self.bucket_bytes)
        ordered = [t.cpu() for t in ordered_tensors(layout, tensors)]
        seg = self._segment(layout.total_bytes)
        pairs = self._pairs.pairs(layout, ordered, seg.data, into_flat=True)
        seg.lock(exclusive=True)
        try:
            seg.version = _WRITING
            copy_pairs(pairs)
            seg.version = version
        finally:
            seg.unlock()
        self.latest = WeightManifest(
            self.policy, version, self.transport, layout, handle=ShmHandle(seg.path, seg.capacity)
        )
        return self.latest

    def _drop_segment(self) -> None:
        if self._seg is not None:
            # Engines keep their own mapping of an unlinked segment until they move on; unlinking only
            # removes the name, so nobody reading it is disturbed.
            os.unlink(self._seg.path)
            self._seg.close()
            self._seg = None

    def close(self) -> None:
        self._drop_segment()
        self.latest = None


class ShmReceiver(WeightReceiver):
    transport: ClassVar[str] = "shm"

    def __init__(self) -> None:
        self._seg: _Mapping | None = None
        self._pairs = PairCache()

    def _segment(self, handle: ShmHandle) -> _Mapping:
        if self._seg is None or self._seg.path != handle.path:
            self.close()
            self._seg = _Mapping(handle.path, handle.capacity, create=False)
        return self._seg

    def receive(self, manifest: WeightManifest, target: WeightTarget) -> SyncReport:
        start = time.perf_counter()
        check_manifest(manifest, target)
        if manifest.version == target.version:
            return make_report(manifest, start, 0.0, applied=False)
        handle: ShmHandle = manifest.handle
        seg = self._segment(handle)
        own = target.named_tensors()
        ordered = [own[s.name] for s in manifest.layout.specs]
        layout = manifest.layout
        pairs = self._pairs.pairs(layout, ordered, seg.data, into_flat=False)
        seg.lock(exclusive=False)
        try:
            found = seg.version
            if found != manifest.version:
                raise WeightSyncError(
                    f"{manifest.policy}: shm segment holds version {found}, not {manifest.version} "
                    "(a newer version was published); the engine keeps its current weights"
                )
            pause_start = time.perf_counter()
            with target.paused(manifest.version):
                copy_pairs(pairs)
            pause = time.perf_counter() - pause_start
        finally:
            seg.unlock()
        return make_report(manifest, start, pause, applied=True)

    def close(self) -> None:
        if self._seg is not None:
            self._seg.close()
            self._seg = None
