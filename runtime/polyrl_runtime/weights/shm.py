"""`shm` transport: trainer and engines on one host share a persistent memory-mapped segment.

The segment (a file in /dev/shm) is created once and reused by every sync while the model fits, since
mapping fresh shared memory per sync costs page faults on every byte (measured 3x slower). It holds
the whole latest version (so a late joiner reads it from there) after a header of per-chunk flags.

A sync is pipelined: `publish` returns the manifest at once and a writer thread packs the version
chunk by chunk (`CHUNK` bytes, smaller than a bucket so that even a one-bucket model pipelines),
stamping each chunk's flag with the version when its bytes are in place. An engine, given the one
manifest, follows the flags: it copies chunk i into its private staging buffer while the writer packs
chunk i+1, so end to end costs about one copy's time on two cores instead of two copies in a row.
There is no per-chunk message: the flags in shared memory are the only signal.

The writer never waits for readers (a reader that dies or stalls cannot wedge the trainer); a reader
detects being overtaken instead, as in a seqlock: the writer marks a chunk `_WRITING` before it
overwrites it, and a reader re-reads the chunk's flag after copying it, so a copy that may be torn is
rejected and the engine keeps its old version. Readers wait for a chunk at most `timeout_s` without
progress (a writer that died mid-sync) and then fail with a clear error. The flag protocol relies on
stores becoming visible in program order (x86-64 TSO; the copies and flag writes are separate torch
calls, with the GIL hand-offs between them acting as compiler barriers).

The engine applies only a complete, validated version (see `staging.py`): by swapping its tensors to
views of the staging buffer where the target allows, else by one copy during the engine pause.
"""

from __future__ import annotations

import os
import tempfile
import threading
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
from polyrl_runtime.weights.buckets import BucketLayout, PairCache, copy_pairs, layout_for, ordered_tensors
from polyrl_runtime.weights.staging import ALIGN, Staging

log = structlog.get_logger(__name__)

# Pipelining granularity: small enough that packing and reading overlap well for a 64 MiB model,
# large enough that the per-chunk Python work (a flag poll, one copy call) is noise.
CHUNK = 8 << 20
_WRITING = -1
# Header words (int64): 0 the version being (or last) published, 1 the version whose writer failed.
_VERSION, _FAILED, _FLAGS = 0, 1, 8
_POLL_S = 50e-6


@dataclass(frozen=True)
class ShmHandle:
    path: str
    capacity: int  # data bytes after the header
    chunks: int  # flags in the header


def _shm_dir() -> str:
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else tempfile.gettempdir()


def _header_bytes(chunks: int) -> int:
    return -(-(8 * (_FLAGS + chunks)) // 4096) * 4096  # page-aligned data after it


class _Mapping:
    """One mapped segment: header words, per-chunk flags, then the data."""

    def __init__(self, path: str, capacity: int, chunks: int, *, create: bool) -> None:
        header = _header_bytes(chunks)
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, header + capacity)
            finally:
                os.close(fd)
        elif not os.path.exists(path):
            raise WeightSyncError(
                f"shm segment {path} not found: the shm transport needs the engine on the trainer's host"
            )
        self.path = path
        self.capacity = capacity
        self.chunks = chunks
        self.buf = torch.from_file(path, shared=True, size=header + capacity, dtype=torch.uint8)
        self.words = self.buf[:header].view(torch.int64)
        self.flags = self.words[_FLAGS : _FLAGS + chunks]
        self.data = self.buf[header:]

    def word(self, i: int) -> int:
        return int(self.words[i])

    @property
    def handle(self) -> ShmHandle:
        return ShmHandle(self.path, self.capacity, self.chunks)


class ShmSender(WeightSender):
    transport: ClassVar[str] = "shm"

    def __init__(self, policy: str, bucket_bytes: int, directory: str | None = None) -> None:
        super().__init__(policy, bucket_bytes)
        self._dir = directory or _shm_dir()
        self._seg: _Mapping | None = None
        self._pairs = PairCache()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _segment(self, layout: BucketLayout) -> _Mapping:
        nbytes, chunks = layout.total_bytes, len(layout.buckets)
        seg = self._seg
        if seg is not None and seg.capacity >= nbytes and seg.chunks >= chunks:
            return seg
        self._drop_segment()
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.policy)
        path = os.path.join(self._dir, f"polyrl-weights-{safe}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        # Round up so a model that grows slightly (or a different bucket size) reuses the segment.
        capacity = max(1, nbytes + nbytes // 16)
        seg = _Mapping(path, capacity, max(1, chunks + chunks // 16), create=True)
        seg.words[_VERSION] = _WRITING
        seg.words[_FAILED] = _WRITING
        seg.flags.fill_(_WRITING)
        self._seg = seg
        log.info("weights.shm.segment", policy=self.policy, path=path, capacity=capacity)
        return seg

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightManifest:
        """Start packing `version` and return its manifest at once.

        The tensors must not change until the version is packed: until `wait()` returns, or until an
        engine has applied this version (it read every chunk, so the writer is past its last one).
        """
        self.wait()
        self._check_version(version)
        layout = layout_for(tensors, min(self.bucket_bytes, CHUNK), align=ALIGN)
        ordered = [t.cpu() for t in ordered_tensors(layout, tensors)]
        seg = self._segment(layout)
        per_bucket = self._pairs.per_bucket(layout, ordered, seg.data, into_flat=True)
        # Every chunk is marked before the version is announced: a reader of an older version then
        # sees each chunk it has yet to check as overwritten, and a reader of this one waits.
        seg.flags.fill_(_WRITING)
        seg.words[_VERSION] = version
        self.latest = WeightManifest(self.policy, version, self.transport, layout, handle=seg.handle)
        self._error = None
        self._thread = threading.Thread(
            target=self._pack, args=(seg, version, per_bucket), name=f"polyrl-shm-{self.policy}", daemon=True
        )
        self._thread.start()
        return self.latest

    def _pack(
        self, seg: _Mapping, version: int, per_bucket: list[list[tuple[torch.Tensor, torch.Tensor]]]
    ) -> None:
        try:
            for i, pairs in enumerate(per_bucket):
                copy_pairs(pairs)
                seg.flags[i] = version
        except BaseException as e:  # re-raised in wait(); readers fail fast on the marker
            self._error = e
            seg.words[_FAILED] = version
            log.error("weights.shm.pack_failed", policy=self.policy, version=version, error=str(e))

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise WeightSyncError(f"{self.policy}: packing into shared memory failed: {err}") from err

    def _drop_segment(self) -> None:
        if self._seg is not None:
            # Engines keep their own mapping of an unlinked segment until they move on; unlinking only
            # removes the name, so nobody reading it is disturbed.
            os.unlink(self._seg.path)
            self._seg = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._drop_segment()
            self.latest = None


class ShmReceiver(WeightReceiver):
    transport: ClassVar[str] = "shm"

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._seg: _Mapping | None = None
        self._staging = Staging()

    def _segment(self, handle: ShmHandle) -> _Mapping:
        if self._seg is None or self._seg.handle != handle:
            self._seg = None
            self._seg = _Mapping(handle.path, handle.capacity, handle.chunks, create=False)
        return self._seg

    def _stale(self, manifest: WeightManifest, seg: _Mapping) -> WeightSyncError:
        return WeightSyncError(
            f"{manifest.policy}: shm segment holds version {seg.word(_VERSION)}, not {manifest.version} "
            "(a newer version was published); the engine keeps its current weights"
        )

    def _await_chunk(self, manifest: WeightManifest, seg: _Mapping, i: int) -> None:
        """Return once chunk i holds the manifest's version; raise if it never will."""
        version = manifest.version
        deadline = time.monotonic() + self.timeout_s
        while True:
            flag = int(seg.flags[i])
            if flag == version:
                return
            if seg.word(_VERSION) != version or flag > version:
                raise self._stale(manifest, seg)
            if seg.word(_FAILED) == version:
                raise WeightSyncError(
                    f"{manifest.policy}: the trainer failed while packing version {version}; "
                    "the engine keeps its current weights"
                )
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"{manifest.policy}: chunk {i} of version {version} did not arrive within "
                    f"{self.timeout_s:.0f} s (the trainer stalled or died mid-sync); "
                    "the engine keeps its current weights"
                )
            time.sleep(_POLL_S)

    def receive(self, manifest: WeightManifest, target: WeightTarget) -> SyncReport:
        start = time.perf_counter()
        check_manifest(manifest, target)
        if manifest.version == target.version:
            return make_report(manifest, start, 0.0, applied=False)
        layout = manifest.layout
        seg = self._segment(manifest.handle)
        if seg.word(_VERSION) != manifest.version:
            raise self._stale(manifest, seg)
        flat = self._staging.buffer(layout, target)
        for i, bucket in enumerate(layout.buckets):
            self._await_chunk(manifest, seg, i)
            lo, hi = bucket.offset, bucket.offset + bucket.nbytes
            copy_pairs([(flat[lo:hi], seg.data[lo:hi])])
            # Seqlock check: the writer marks a chunk before overwriting it, so an unchanged flag
            # after the copy means the copy is not torn.
            if int(seg.flags[i]) != manifest.version:
                raise self._stale(manifest, seg)
        pause = self._staging.apply(manifest, target, flat)
        return make_report(manifest, start, pause, applied=True)

    def close(self) -> None:
        self._seg = None
        self._staging.close()
