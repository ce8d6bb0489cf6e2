"""`shm` transport: trainer and engines on one host share a persistent memory-mapped segment.

The segment (a file in /dev/shm) is created once and reused by every sync while the model fits, since
mapping fresh shared memory per sync costs page faults on every byte (measured 3x slower). It has two
*slots*, each able to hold a whole version; the trainer packs version v into the slot that does not
hold the latest version (host copies split over threads; torch releases the GIL), so the latest one
stays intact for late joiners and for engines still serving it.

An engine whose target can swap its tensors (every `TensorTarget.from_module`, so the torch engine)
does not copy at all: it validates the manifest and rebinds its tensors to dtype views of the slot,
so a sync costs one copy end to end (the trainer's packing) and the engine pause is O(1). A target
that must be written in place gets one copy from the slot during the pause, as before.

Who may write a slot is settled by one `flock` per slot (a small file next to the segment): the
trainer holds it exclusive while packing; an engine holds it shared while it reads the slot, and
keeps holding it for as long as it serves weights that live there. The trainer never waits for an
engine: when the slot it wants is still in use (an engine that missed a version, or stalled), it
leaves the whole segment to its readers (unlinking only removes the name; their mappings stay valid)
and starts a new one. A dead engine's locks are dropped by the kernel. An engine waits for a slot
being packed at most `timeout_s`, then fails with a clear error and keeps its old version.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import structlog
import torch

from polyrl_runtime.weights.api import (
    SyncReport,
    TensorTarget,
    WeightManifest,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightTarget,
    check_manifest,
    make_report,
    swappable,
)
from polyrl_runtime.weights.buckets import BucketLayout, PairCache, layout_for, ordered_tensors, run_copies
from polyrl_runtime.weights.staging import ALIGN, flat_views

log = structlog.get_logger(__name__)

_SLOTS = 2
_HEADER = 4096  # page-aligned slots after it
_WRITING = -1
# Header words (int64): the latest published version, then each slot's version (_WRITING while packed).
_LATEST, _SLOT_VERSION = 0, 8
_POLL_S = 1e-3


@dataclass(frozen=True)
class ShmHandle:
    path: str
    capacity: int  # bytes per slot
    slot: int


def _shm_dir() -> str:
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else tempfile.gettempdir()


def _lock_path(path: str, slot: int) -> str:
    return f"{path}.slot{slot}.lock"


class _Mapping:
    """One mapped segment and this process's descriptors of its slot locks (flock is per descriptor,
    so a trainer and an engine in one process still exclude each other)."""

    def __init__(self, path: str, capacity: int, *, create: bool) -> None:
        size = _HEADER + _SLOTS * capacity
        try:
            if create:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, size)
                os.close(fd)
            flags = os.O_RDWR | (os.O_CREAT if create else 0)
            self._locks = [os.open(_lock_path(path, s), flags, 0o600) for s in range(_SLOTS)]
        except FileNotFoundError as e:
            raise WeightSyncError(
                f"shm segment {path} not found: the shm transport needs the engine on the trainer's host"
            ) from e
        self.path = path
        self.capacity = capacity
        self.buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self.words = self.buf[:_HEADER].view(torch.int64)
        if create:
            self.words.fill_(_WRITING)

    def slot(self, s: int) -> torch.Tensor:
        return self.buf[_HEADER + s * self.capacity : _HEADER + (s + 1) * self.capacity]

    def version(self, s: int) -> int:
        return int(self.words[_SLOT_VERSION + s])

    def try_lock(self, s: int, *, exclusive: bool) -> bool:
        try:
            fcntl.flock(self._locks[s], (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self, s: int) -> None:
        fcntl.flock(self._locks[s], fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in self._locks:
            os.close(fd)  # also drops any lock held through it
        self._locks = []


class ShmSender(WeightSender):
    transport: ClassVar[str] = "shm"

    def __init__(self, policy: str, bucket_bytes: int, directory: str | None = None) -> None:
        super().__init__(policy, bucket_bytes)
        self._dir = directory or _shm_dir()
        self._seg: _Mapping | None = None
        self._slot = -1  # the slot holding the latest version
        self._pairs = PairCache(entries=_SLOTS)

    def _new_segment(self, nbytes: int) -> _Mapping:
        self._drop_segment()
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.policy)
        path = os.path.join(self._dir, f"polyrl-weights-{safe}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        # Round up so a model that grows slightly (or a different bucket size) reuses the segment;
        # page-aligned so each slot's tensors are aligned for any dtype view.
        capacity = -(-max(1, nbytes + nbytes // 16) // 4096) * 4096
        self._seg = _Mapping(path, capacity, create=True)
        self._slot = -1
        log.info("weights.shm.segment", policy=self.policy, path=path, slot_bytes=capacity)
        return self._seg

    def _claim_slot(self, layout: BucketLayout) -> tuple[_Mapping, int]:
        """A segment and slot to pack into, locked exclusive; never waits for an engine."""
        seg = self._seg
        if seg is None or seg.capacity < layout.total_bytes:
            seg = self._new_segment(layout.total_bytes)
        slot = (self._slot + 1) % _SLOTS
        if not seg.try_lock(slot, exclusive=True):
            # An engine still serves (or reads) an older version there: leave it that segment.
            log.info("weights.shm.slot_busy", policy=self.policy, path=seg.path, slot=slot)
            seg = self._new_segment(layout.total_bytes)
            slot = 0
            if not seg.try_lock(slot, exclusive=True):  # pragma: no cover - nobody else knows the name
                raise WeightSyncError(f"{self.policy}: cannot lock a new shm segment {seg.path}")
        return seg, slot

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightManifest:
        self._check_version(version)
        layout = layout_for(tensors, self.bucket_bytes, align=ALIGN)
        ordered = [t.cpu() for t in ordered_tensors(layout, tensors)]
        seg, slot = self._claim_slot(layout)
        try:
            seg.words[_SLOT_VERSION + slot] = _WRITING
            run_copies(self._pairs.plan(layout, ordered, seg.slot(slot), into_flat=True))
            seg.words[_SLOT_VERSION + slot] = version
            seg.words[_LATEST] = version
        finally:
            seg.unlock(slot)
        self._slot = slot
        self.latest = WeightManifest(
            self.policy, version, self.transport, layout, handle=ShmHandle(seg.path, seg.capacity, slot)
        )
        return self.latest

    def _drop_segment(self) -> None:
        if self._seg is not None:
            # Engines keep their own mapping of an unlinked segment (and their lock descriptors) until
            # they move on; unlinking only removes the names, so nobody reading it is disturbed.
            for p in [self._seg.path, *(_lock_path(self._seg.path, s) for s in range(_SLOTS))]:
                os.unlink(p)
            self._seg.close()
            self._seg = None

    def close(self) -> None:
        self._drop_segment()
        self.latest = None


class ShmReceiver(WeightReceiver):
    transport: ClassVar[str] = "shm"

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._maps: dict[str, _Mapping] = {}
        # The (path, slot) each swapped target serves from, and the slots this receiver holds shared
        # locks on: a slot stays locked while any live target serves from it.
        self._serving: weakref.WeakKeyDictionary[TensorTarget, tuple[str, int]] = weakref.WeakKeyDictionary()
        self._locked: set[tuple[str, int]] = set()
        # Typed views of each slot, kept per (path, slot): building a thousand views costs more than
        # the rest of a sync, and syncs alternate between the two slots.
        self._views: dict[tuple[str, int], tuple[object, dict[str, torch.Tensor]]] = {}
        self._pairs = PairCache()

    def _mapping(self, handle: ShmHandle) -> _Mapping:
        seg = self._maps.get(handle.path)
        if seg is None:
            seg = self._maps[handle.path] = _Mapping(handle.path, handle.capacity, create=False)
        return seg

    def _lock_slot(self, manifest: WeightManifest, seg: _Mapping, slot: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not seg.try_lock(slot, exclusive=False):
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"{manifest.policy}: shm slot of version {manifest.version} still being written after "
                    f"{self.timeout_s:.0f} s; the engine keeps its current weights"
                )
            time.sleep(_POLL_S)

    def receive(self, manifest: WeightManifest, target: WeightTarget) -> SyncReport:
        start = time.perf_counter()
        check_manifest(manifest, target)
        if manifest.version == target.version:
            return make_report(manifest, start, 0.0, applied=False)
        handle: ShmHandle = manifest.handle
        seg = self._mapping(handle)
        self._lock_slot(manifest, seg, handle.slot)
        keep = False
        if (handle.path, handle.slot) in self._locked:
            # Already held for a target serving this slot; flock would not count a second hold, so
            # this read relies on that one (the trainer cannot be writing a slot we hold).
            keep = True
        try:
            latest, found = int(seg.words[_LATEST]), seg.version(handle.slot)
            if found != manifest.version or latest > manifest.version:
                raise WeightSyncError(
                    f"{manifest.policy}: shm segment holds version {max(latest, found)}, not "
                    f"{manifest.version} (a newer version was published); the engine keeps its current weights"
                )
            data = seg.slot(handle.slot)
            if swappable(target) and all(t.device.type == "cpu" for t in target.named_tensors().values()):
                pause = self._swap_in(manifest, target, data)
                keep = True  # the shared lock now guards the weights the engine serves
            else:
                own = target.named_tensors()
                ordered = [own[s.name] for s in manifest.layout.specs]
                plan = self._pairs.plan(manifest.layout, ordered, data, into_flat=False)
                pause_start = time.perf_counter()
                with target.paused(manifest.version):
                    run_copies(plan)
                pause = time.perf_counter() - pause_start
        finally:
            if not keep:
                seg.unlock(handle.slot)
        self._release_unused(handle.path)
        return make_report(manifest, start, pause, applied=True)

    def _swap_in(self, manifest: WeightManifest, target: WeightTarget, data: torch.Tensor) -> float:
        assert isinstance(target, TensorTarget)
        handle: ShmHandle = manifest.handle
        where = (handle.path, handle.slot)
        cached = self._views.get(where)
        if cached is None or cached[0] != (manifest.layout, handle):
            cached = self._views[where] = ((manifest.layout, handle), flat_views(manifest.layout, data))
        pause_start = time.perf_counter()
        with target.paused(manifest.version):
            target.swap(cached[1])
        pause = time.perf_counter() - pause_start
        self._serving[target] = (handle.path, handle.slot)
        self._locked.add((handle.path, handle.slot))
        return pause

    def _release_unused(self, current: str) -> None:
        """Unlock slots no live target serves from; close segments neither served nor just given."""
        in_use = set(self._serving.values())
        for path, slot in self._locked - in_use:
            if path in self._maps:
                self._maps[path].unlock(slot)
        self._locked &= in_use
        keep = {current} | {path for path, _ in in_use}
        for path in [p for p in self._maps if p not in keep]:
            self._maps.pop(path).close()
        self._views = {w: v for w, v in self._views.items() if w[0] in keep}

    def close(self) -> None:
        # Segments a target serves from stay mapped and locked while this receiver lives: the target
        # may still serve those views, and the lock is what keeps the trainer off them.
        self._release_unused("")
        self._views = {}
