"""Moving the memory of a set of tensors to host memory and back, leaving every tensor object as it is.

Engines that sleep and trainers that offload between the phases of a shared device pool park their
tensors here. Parking works on storages, not on tensors: each storage's bytes are copied into a host
buffer (pinned for a CUDA storage), then the storage is released in place (`resize_(0)`, as FSDP
frees a parameter's storage); restoring allocates it again on its device and copies the bytes back.
Every tensor that views a storage (a parameter, the flat buffer DeepSpeed keeps it in, optimizer
state keyed on it, a weight-sync staging buffer) keeps pointing at the same storage object, so
aliasing between tensors survives exactly, whoever holds them, and a round trip changes no bit.

Completeness is not needed for correctness: a storage the caller did not reach stays where it is
(it is only not freed). A storage that cannot be resized in place (memory torch does not own: a
numpy array, a mapped object-store buffer) stays too, and is counted in `kept_bytes`.

Invariant the callers keep: no tensor of a parked storage is read or written until `restore`. Its
storage has no bytes then, and torch does not check a tensor against its storage's size: a read
would touch freed memory. The engines and trainers refuse every call that would (see their sleep
and offload methods).

On the CPU the host is the device: parking copies each storage into a separate host buffer and
releases the original, the same code path as on a GPU, so CPU tests exercise it.

Pinning host memory costs more than the copy into it (measured on an H200: 1.6-2.5 GB/s offloading
a 1 GB trainer state into freshly pinned buffers, against 52 GB/s restoring it). An owner that parks
again and again (a pooled trainer or engine, every turn) passes the same `HostBuffers`: `restore`
gives the buffers back to it and the next `park` copies into them, so the host memory a role needs
while parked stays pinned between turns instead of being pinned anew.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


class HostBuffers:
    """Host buffers kept for reuse by one owner between its parks (see the module docstring), by
    size and whether they are pinned."""

    def __init__(self) -> None:
        self._free: defaultdict[tuple[int, bool], list[torch.Tensor]] = defaultdict(list)
        self.allocated = 0  # buffers created: a steady owner stops creating them after its first park

    def take(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        free = self._free[(nbytes, pinned)]
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def give(self, buffer: torch.Tensor) -> None:
        self._free[(buffer.numel(), buffer.is_pinned())].append(buffer)

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() for bufs in self._free.values() for b in bufs)


@dataclass(frozen=True)
class _Slot:
    """One released storage and, unless its bytes were dropped, their host copy."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 [nbytes]


@dataclass
class ParkedMemory:
    """Storages released by `park`; `restore` gives each its bytes back (or, for dropped ones,
    room for them: their contents are then undefined until the owner writes them)."""

    slots: list[_Slot] = field(default_factory=list)
    kept_bytes: int = 0  # storages found but not releasable (see the module docstring)
    seconds: float = 0.0
    restored: bool = False
    buffers: HostBuffers | None = None  # where the host copies go back after `restore`

    @property
    def nbytes(self) -> int:
        """Bytes released from their device (copied to the host, or dropped)."""
        return sum(s.nbytes for s in self.slots)

    @property
    def host_bytes(self) -> int:
        """Bytes held in host copies."""
        return sum(s.nbytes for s in self.slots if s.host is not None)

    def restore(self, owner: str) -> float:
        """Reallocate every released storage on its device and copy its bytes back; the seconds it
        took. `owner` names the engine or rank in errors. A restore that fails (the device is out of
        memory) may be retried: the host copies stay until one succeeds."""
        if self.restored:
            raise RuntimeError(f"{owner}: its memory was restored already")
        start = time.perf_counter()
        devices = {s.storage.device for s in self.slots}
        try:
            for slot in self.slots:
                slot.storage.resize_(slot.nbytes)
                if slot.host is not None:
                    _bytes_of(slot.storage).copy_(slot.host, non_blocking=slot.host.is_pinned())
            _synchronize(devices)
        except torch.OutOfMemoryError as e:
            where = ", ".join(sorted(str(d) for d in devices))
            raise RestoreError(owner, self.nbytes, where, str(e)) from e
        if self.buffers is not None:
            for slot in self.slots:
                if slot.host is not None:
                    self.buffers.give(slot.host)
        self.slots = [_Slot(s.storage, s.nbytes, None) for s in self.slots]  # the host copies go
        self.restored = True
        return time.perf_counter() - start


class RestoreError(RuntimeError):
    """Parked memory could not come back: its device has no room for it."""

    def __init__(self, owner: str, nbytes: int, device: str, cause: str) -> None:
        super().__init__(
            f"{owner}: cannot bring back {nbytes} bytes ({nbytes / 2**30:.2f} GiB) to {device}: {cause}"
        )
        self.owner, self.nbytes, self.device, self.cause = owner, nbytes, device, cause

    def __reduce__(self) -> tuple[type[RestoreError], tuple[str, int, str, str]]:
        return RestoreError, (self.owner, self.nbytes, self.device, self.cause)  # through Ray


def unique_storages(
    tensors: Iterable[torch.Tensor], device: torch.device | None = None
) -> list[torch.UntypedStorage]:
    """The distinct storages behind `tensors` that hold bytes (on `device` only, when given), in
    first-seen order."""
    seen: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or (device is not None and not _same_device(storage.device, device)):
            continue
        seen.setdefault(_key(storage), storage)
    return list(seen.values())


def park(
    keep: Iterable[torch.UntypedStorage] = (),
    drop: Iterable[torch.UntypedStorage] = (),
    buffers: HostBuffers | None = None,
) -> ParkedMemory:
    """Release storages from their devices: those of `keep` are copied to host memory first (into
    `buffers`' when given), those of `drop` (not also in `keep`) are not (their owner must write
    them again after `restore`)."""
    start = time.perf_counter()
    out = ParkedMemory(buffers=buffers)
    kept = list(keep)
    keys = {_key(s) for s in kept}
    copies: list[tuple[torch.UntypedStorage, torch.Tensor | None]] = []
    for storage, copy in [*((s, True) for s in kept), *((s, False) for s in drop if _key(s) not in keys)]:
        if not storage.resizable():
            out.kept_bytes += storage.nbytes()
            continue
        host = None
        if copy:
            cuda = storage.device.type == "cuda"
            if buffers is not None:
                host = buffers.take(storage.nbytes(), pinned=cuda)
            else:
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=cuda)
            host.copy_(_bytes_of(storage), non_blocking=cuda)
        copies.append((storage, host))
    _synchronize({s.device for s, _ in copies})  # every copy has landed before any storage goes
    for storage, host in copies:
        nbytes = storage.nbytes()
        try:
            storage.resize_(0)
        except RuntimeError:  # memory torch cannot reallocate (shared or mapped): it stays
            out.kept_bytes += nbytes
            continue
        out.slots.append(_Slot(storage, nbytes, host))
    if any(s.storage.device.type == "cuda" for s in out.slots):
        torch.cuda.empty_cache()  # back to the driver: another process on the device may use it
    out.seconds = time.perf_counter() - start
    return out


def park_module(
    module: torch.nn.Module,
    *,
    keep_parameters: bool,
    device: torch.device | None = None,
    buffers: HostBuffers | None = None,
) -> ParkedMemory:
    """Release a module's memory (on `device` only, when given): its buffers are kept (copied to host
    memory: they are derived from the config, and no weight update brings them), its parameters kept
    or, unless `keep_parameters`, dropped."""
    params = unique_storages((p.data for p in module.parameters()), device)
    module_buffers = unique_storages(module.buffers(), device)
    if keep_parameters:
        return park(keep=[*params, *module_buffers], buffers=buffers)
    return park(keep=module_buffers, drop=params, buffers=buffers)


def storage_bytes(storages: Iterable[torch.UntypedStorage]) -> int:
    return sum(s.nbytes() for s in storages)


def _key(storage: torch.UntypedStorage) -> tuple[torch.device, int]:
    """Distinct live storages with bytes have distinct (device, address)."""
    return storage.device, storage.data_ptr()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _synchronize(devices: Iterable[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
