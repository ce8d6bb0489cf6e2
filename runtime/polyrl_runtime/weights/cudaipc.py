"""`cudaipc` transport: engines on the trainer's GPU copy the trainer's tensors through CUDA IPC.

For a colocated policy (its rollout and trainer on one device pool) the engine and the trainer rank
that publishes run on one GPU host, often on one GPU, where NCCL refuses to put two ranks on a
device. Here nothing crosses a network: the manifest carries CUDA IPC handles of the trainer's own
tensors (`torch.multiprocessing.reductions.reduce_tensor`), and the engine maps them and copies
device to device into its tensors, bucket by bucket, inside its pause. The sender stages nothing,
so a sync costs no device memory beyond the engine's own weights.

The handle names the sender's GPU by UUID (an engine looks for it among its visible devices, whose
indices may differ from the trainer's) and shares each *storage* once: tensors that share one, such
as DeepSpeed's flat parameter buffers, share its handle and differ by byte offset. A storage is
shared through a non-owning alias of its memory, never itself: torch wraps a storage it shares in a
new reference-counted record each time, so sharing the trainer's parameters at every publish would
stack records on them for the whole run.

The published tensors are the trainer's, so they can serve a version only until the trainer changes
them. A small guard file on the host (`ServeGuard`) records which version they hold: the sender
writes it at publish and clears it at `release_source()` (which a trainer calls before its optimizer
step, a load or an offload); engines hold a shared `flock` on it while they read the tensors, and the
sender an exclusive one while it rewrites the word, so it never clears a version an engine is still
copying. An engine handed a version that is no longer held (a late joiner after `release_source()`)
fails with a clear `WeightSyncError` before its pause and keeps its weights; the next publish brings
it. Only a sender that gave up waiting for a stalled engine (`timeout_s`) can change the tensors under
a copy; the engine then sees the cleared word afterwards and reports its weights as possibly torn.
torch also counts the consumers of each shared storage: the sender's share sets a counter to 1,
and a consumer decrements the counter its handle names when it frees its mapping; a producer that
frees a storage whose counter is above zero parks it (torch's "limbo") until the counter drops.
Liveness is the guard's job here, so handles send the engines' decrements to a `CounterSink` of the
sender's, and the sender returns its alias's count itself when it drops the alias: every alias is
freed at once, whether no engine, one or several mapped it.

An engine in the trainer's own process (CUDA refuses to open an IPC handle where it was made) reads
the sender's tensors directly: the handle names its process and sender.

The handle itself and torch's IPC calls are in `cudaipc_handle.py`. `CudaIpcReceiver.read` is an
engine's side of the protocol, whatever it does with the bytes: `receive` copies them into a
`WeightTarget`, and the vLLM worker extension (`engines/vllm_worker.py`) hands views of them to the
model's `load_weights`.

The guard file and torch's IPC reference counters live in /dev/shm: engines and trainer must share it
(processes of one pod do).
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

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
from polyrl_runtime.weights.buckets import Bucket, Pair, byte_view, layout_for
from polyrl_runtime.weights.cudaipc_handle import (
    CudaIpcHandle,
    StorageShare,
    map_storages,
    share_storage,
    this_process,
)
from polyrl_runtime.weights.serve_guard import NOT_SERVED, CounterSink, ServeGuard, guard_dir

log = structlog.get_logger(__name__)

TRANSPORT = "cudaipc"
# The sender's layouts (`layout_for`'s align): nothing is staged, so nothing needs padding.
LAYOUT_ALIGN = 1

# This process's live senders by id, for receivers in the same process.
_SENDERS: weakref.WeakValueDictionary[str, CudaIpcSender] = weakref.WeakValueDictionary()


def _publish_device(policy: str, tensors: Mapping[str, torch.Tensor]) -> torch.device | None:
    devices: set[torch.device] = set()
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise WeightSyncError(
                f"{policy}: tensor {name!r} is on {t.device}: cudaipc needs CUDA tensors (engines map "
                "the trainer's GPU memory); use another transport for a trainer on CPU"
            )
        if t.layout != torch.strided:
            raise WeightSyncError(f"{policy}: tensor {name!r} is not dense ({t.layout})")
        devices.add(t.device)
    if len(devices) > 1:
        raise WeightSyncError(
            f"{policy}: tensors on {sorted(map(str, devices))}: cudaipc publishes from one GPU"
        )
    return next(iter(devices), None)


class CudaIpcSender(WeightSender):
    transport: ClassVar[str] = TRANSPORT

    def __init__(
        self, policy: str, bucket_bytes: int, *, directory: str | None = None, timeout_s: float = 600.0
    ) -> None:
        super().__init__(policy, bucket_bytes)
        self.timeout_s = timeout_s
        self.id = uuid.uuid4().hex
        self._guard = ServeGuard.create(directory or guard_dir(), policy)
        self._sink = CounterSink(policy) if torch.cuda.is_available() else None
        self._remove_files = weakref.finalize(self, _remove_files, self._guard, self._sink)
        # The published tensors (contiguous, layout order) and their shares, while they hold `latest`.
        self._source: list[torch.Tensor] | None = None
        self._shares: list[StorageShare] = []
        # publish / resend / release_source run on different threads of a trainer actor.
        self._lock = threading.Lock()
        _SENDERS[self.id] = self

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightManifest:
        with self._lock:
            self._check_version(version)
            device = _publish_device(self.policy, tensors)
            layout = layout_for(tensors, self.bucket_bytes, LAYOUT_ALIGN)
            ordered = [tensors[s.name].detach().contiguous() for s in layout.specs]
            with self._exclusive():
                self._drop_source()
                storages: list[tuple[Any, ...]] = []
                locations: list[tuple[int, int]] = []
                index: dict[int, int] = {}
                for spec, t in zip(layout.specs, ordered, strict=True):
                    if t.numel() == 0:
                        locations.append((-1, 0))
                        continue
                    storage = t.untyped_storage()
                    i = index.get(storage.data_ptr())
                    if i is None:
                        assert self._sink is not None  # CUDA tensors: CUDA is available
                        args, share = share_storage(self.policy, spec.name, storage, self._sink.shm_name)
                        i = index[storage.data_ptr()] = len(storages)
                        storages.append(args)
                        self._shares.append(share)
                    locations.append((i, int(t.storage_offset()) * t.element_size()))
                if device is not None:
                    torch.cuda.synchronize(device)  # engines read finished data
                uuid_ = str(torch.cuda.get_device_properties(device).uuid) if device is not None else ""
                handle = CudaIpcHandle(
                    uuid_, this_process(), self.id, self._guard.path, tuple(storages), tuple(locations)
                )
                self._source = ordered
                self.latest = WeightManifest(self.policy, version, self.transport, layout, handle=handle)
                self._guard.set_served(version)
            return self.latest

    def source(self, version: int) -> list[torch.Tensor] | None:
        """The published tensors while they hold `version` (for a receiver in this process, which
        holds the guard shared while it reads them)."""
        latest = self.latest
        return self._source if latest is not None and latest.version == version else None

    def resend(self) -> WeightManifest | None:
        """The latest version for engines that just joined; None once `release_source()` ran (the
        next publish brings them)."""
        with self._lock:
            if self.latest is None:
                raise WeightSyncError(f"{self.policy}: nothing published yet")
            return self.latest if self._source is not None else None

    def release_source(self) -> None:
        """The caller is about to change the published tensors: wait for engines reading them, then
        mark the latest version as no longer served and drop the tensors and their shares."""
        with self._lock:
            if self._source is not None or self._shares:
                with self._exclusive():
                    self._drop_source()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        held = self._guard.acquire(exclusive=True, timeout_s=self.timeout_s)
        if not held:
            # An engine stalled in a copy (a live process: a dead one's lock is gone). The trainer
            # goes on; that engine finds the word changed after its copy and reports it.
            log.warning("weights.cudaipc.reader_stalled", policy=self.policy, waited_s=self.timeout_s)
        try:
            yield
        finally:
            if held:
                self._guard.release()

    def _drop_source(self) -> None:
        self._guard.set_served(NOT_SERVED)
        for share in self._shares:
            # The share's count of 1 is the sender's alone (engines decrement the sink): return it,
            # so freeing the alias frees its record at once (see the module doc).
            torch.UntypedStorage._release_ipc_counter(  # type: ignore[no-untyped-call]
                share.ref_counter, share.ref_counter_offset
            )
        self._shares = []
        self._source = None

    def close(self) -> None:
        with self._lock:
            with self._exclusive():
                self._drop_source()
            self._remove_files()
            _SENDERS.pop(self.id, None)
            self.latest = None


def _remove_files(guard: ServeGuard, sink: CounterSink | None) -> None:
    guard.destroy()
    if sink is not None:
        sink.destroy()


@dataclass(eq=False)
class MappedVersion:
    """One version's tensors in the trainer's memory, readable inside `CudaIpcReceiver.read` only."""

    manifest: WeightManifest
    sources: list[tuple[torch.Tensor, int] | None]
    """Per tensor in layout order: (the trainer's storage as flat uint8, byte offset); None: no bytes."""
    guard: ServeGuard

    def pairs(self, bucket: Bucket, dsts: Sequence[torch.Tensor]) -> list[Pair]:
        """(engine bytes, trainer bytes) of each segment of `bucket`, into `dsts` (layout order)."""
        pairs = []
        for seg in bucket.segments:
            src = self.sources[seg.tensor]
            assert src is not None  # a tensor without bytes has no segment
            flat, offset = src
            start = offset + seg.src_offset
            dst = byte_view(dsts[seg.tensor])[seg.src_offset : seg.src_offset + seg.nbytes]
            pairs.append((dst, flat[start : start + seg.nbytes]))
        return pairs

    def tensor(self, index: int) -> torch.Tensor:
        """Tensor `index` of the layout as the trainer holds it: a view of its memory, no copy."""
        spec = self.manifest.layout.specs[index]
        src = self.sources[index]
        if src is None:
            return torch.empty(spec.shape, dtype=spec.dtype)
        flat, offset = src
        return flat[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)

    def finish(self, devices: Iterable[torch.device]) -> None:
        """After the reader's copies out of the trainer's memory (written on `devices`): wait for them,
        then check the trainer still serves the version; `WeightSyncError` if not (the copies may be
        torn)."""
        waited = {*devices, *(flat.device for flat, _ in filter(None, self.sources))}
        for d in waited:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        _check_served(self.manifest, self.guard.served(), copied=True)


class CudaIpcReceiver(WeightReceiver):
    transport: ClassVar[str] = TRANSPORT

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._guard: ServeGuard | None = None
        self._devices: dict[str, int] | None = None
        # One read at a time: a flock is the open file's, so two readers here would share one.
        self._lock = threading.Lock()

    def receive(self, manifest: WeightManifest, target: WeightTarget) -> SyncReport:
        start = time.perf_counter()
        check_manifest(manifest, target)
        if manifest.version == target.version:
            return make_report(manifest, start, 0.0, applied=False)
        with self.read(manifest) as mapped:
            pause = _copy_into(target, mapped)
        return make_report(manifest, start, pause, applied=True)

    @contextlib.contextmanager
    def read(self, manifest: WeightManifest) -> Iterator[MappedVersion]:
        """The version's tensors in the trainer's memory, while the guard is held shared.

        Refused with `WeightSyncError` before anything is read: an engine off the trainer's GPU host,
        a guard gone or held past `timeout_s`, a version no longer served, a handle that does not fit
        the layout. Every mapping goes before the guard is released (the sender may free that memory
        after), so the block must keep no view of the trainer's memory past its end."""
        handle: CudaIpcHandle = manifest.handle
        if len(handle.locations) != len(manifest.layout.specs):
            raise WeightSyncError(
                f"{manifest.policy}: the cudaipc handle places {len(handle.locations)} tensors, the "
                f"layout has {len(manifest.layout.specs)}"
            )
        with self._lock:
            local = handle.process == this_process()
            device = -1 if local or not handle.storages else self._device(manifest.policy, handle.device_uuid)
            guard = self._open_guard(manifest.policy, handle.guard)
            if not guard.acquire(exclusive=False, timeout_s=self.timeout_s):
                raise WeightSyncError(
                    f"{manifest.policy}: the trainer held the cudaipc guard for {self.timeout_s:g} s; "
                    "the engine keeps its current weights"
                )
            try:
                _check_served(manifest, guard.served(), copied=False)
                mapped = MappedVersion(manifest, _sources(manifest, local, device), guard)
                try:
                    yield mapped
                finally:
                    mapped.sources.clear()
            except BaseException as e:
                # The finished frames a failure passed through hold views of the trainer's memory;
                # the sender may free that memory once the guard is released.
                _clear_frames(e)
                raise
            finally:
                guard.release()

    def _device(self, policy: str, device_uuid: str) -> int:
        if self._devices is None:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            self._devices = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(count)}
        index = self._devices.get(device_uuid)
        if index is None:
            raise WeightSyncError(
                f"{policy}: cudaipc needs the engine on the trainer's GPU host: no visible device has "
                f"UUID {device_uuid} (visible: {sorted(self._devices) or 'none'})"
            )
        return index

    def _open_guard(self, policy: str, path: str) -> ServeGuard:
        if self._guard is not None and self._guard.path == path:
            return self._guard
        try:
            guard = ServeGuard(path, create=False)
        except FileNotFoundError:
            raise WeightSyncError(
                f"{policy}: cudaipc guard {path} is gone: the trainer closed its sender (or the engine "
                "is not on the trainer's host); the engine keeps its current weights"
            ) from None
        except OSError as e:
            raise WeightSyncError(f"{policy}: cannot open the cudaipc guard {path}: {e}") from e
        if self._guard is not None:
            self._guard.close()
        self._guard = guard
        return guard

    def close(self) -> None:
        with self._lock:
            if self._guard is not None:
                self._guard.close()
                self._guard = None


def _copy_into(target: WeightTarget, mapped: MappedVersion) -> float:
    """Copy the version into `target` inside its pause; returns the pause."""
    manifest = mapped.manifest
    own = target.named_tensors()
    dsts = [own[s.name] for s in manifest.layout.specs]
    buckets = [mapped.pairs(b, dsts) for b in manifest.layout.buckets]
    try:
        pause_start = time.perf_counter()
        with target.paused(manifest.version):
            for pairs in buckets:
                for dst, src in pairs:
                    dst.copy_(src)
            mapped.finish(t.device for t in dsts)
        return time.perf_counter() - pause_start
    finally:
        buckets.clear()  # views of the trainer's memory


def _sources(manifest: WeightManifest, local: bool, device: int) -> list[tuple[torch.Tensor, int] | None]:
    """Each tensor's bytes in the trainer's memory (flat uint8, byte offset), checked to lie inside it."""
    handle: CudaIpcHandle = manifest.handle
    sources: list[tuple[torch.Tensor, int] | None]
    if local:
        sources = [(byte_view(t), 0) if t.numel() else None for t in _local_source(manifest, handle)]
    else:
        mapped = map_storages(manifest.policy, handle, device)
        sources = [None if i < 0 else (mapped[i], off) for i, off in handle.locations]
    for spec, src in zip(manifest.layout.specs, sources, strict=True):
        flat, offset = src if src is not None else (None, 0)
        if spec.nbytes and (flat is None or offset < 0 or offset + spec.nbytes > flat.numel()):
            raise WeightSyncError(
                f"{manifest.policy}: tensor {spec.name!r} ({spec.nbytes} bytes) does not lie in the "
                "trainer's memory the cudaipc handle names: the handle is not this layout's"
            )
    return sources


def _clear_frames(e: BaseException) -> None:
    """Clear the finished frames of `e`'s traceback and of every exception it chains to."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        traceback.clear_frames(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__


def _local_source(manifest: WeightManifest, handle: CudaIpcHandle) -> list[torch.Tensor]:
    sender = _SENDERS.get(handle.sender)
    source = sender.source(manifest.version) if sender is not None else None
    if source is None:
        raise WeightSyncError(
            f"{manifest.policy}: version {manifest.version} is no longer held by the trainer's sender "
            "in this process; the engine keeps its current weights"
        )
    return source


def _check_served(manifest: WeightManifest, served: int, *, copied: bool) -> None:
    if served == manifest.version:
        return
    now = "no published version" if served == NOT_SERVED else f"version {served}"
    if copied:
        raise WeightSyncError(
            f"{manifest.policy}: the trainer stopped serving version {manifest.version} while this engine "
            f"copied it (its tensors now hold {now}); the engine's weights may be partly written"
        )
    raise WeightSyncError(
        f"{manifest.policy}: version {manifest.version} is no longer served: the trainer's tensors hold "
        f"{now} (they change after release_source); the engine keeps its current weights and takes the "
        "next publish"
    )
