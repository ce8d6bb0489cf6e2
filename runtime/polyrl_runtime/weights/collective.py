"""`collective` transport: a dedicated torch.distributed group, gloo on CPU and NCCL on GPU.

The group is *not* the default process group: the trainer may already run DeepSpeed in its own
default group, and engines (vLLM) in theirs. As vLLM's `StatelessProcessGroup` does, the sender (rank
0) hosts its own `TCPStore`, and a `ProcessGroupGloo`/`ProcessGroupNCCL` is built directly on a
`PrefixStore` of it. Engines learn the address from the manifest and take ranks 1..n from a counter in
the store, so no rank assignment has to be planned ahead. When the set of engines changes (scale-out,
a restarted engine) the sender bumps the group *generation*; the next manifest names it and everyone
builds the new group lazily.

Data: sender and receivers cut the version into the same broadcasts, a pure function of the layout
(`broadcast_ops`). A piece of a tensor of at least `DIRECT_MIN` bytes is broadcast straight from the
trainer's tensor, with no copy; smaller tensors are packed into one of two chunk-sized buffers, the next
while the previous is on the wire. The sender keeps no copy of the version: on two cores the packing
copy alone cost a fifth of a sync, and on a GPU a full copy would take as much memory as the weights.
So a late joiner is served by `resend()` from the published tensors themselves, for as long as the
trainer has not begun changing them (`release_source()`, which a trainer calls before its optimizer
step); after that `resend()` returns None and the joiner is brought in by the next publish, which
follows every step. Receivers broadcast into a staging buffer and only then, after every byte
arrived and the manifest matched, apply it (see `staging.py`: a swap of the engine's tensors to views
of the buffer where the target allows, else a copy): a failed or mismatched transfer leaves the engine
on its old version.

With `deltas` (weightSync.deltas > 0) the sender keeps a host copy of the version it published last
and broadcasts each next version as the bit-exact deltas from it (weights/delta.py: changed elements
and their positions per tensor, the whole tensor where that is smaller, a CRC-32 of each result), one
encoded link in `CHUNK` pieces. Every engine of the group holds that base, as each receives every
version; one that does not, or whose check fails, raises `DeltaRejectedError` after taking part in
the broadcast, and the driver resends the whole version to the group from the host copy (which also
serves late joiners at any time: `resend` never has to wait for the next publish).
"""

from __future__ import annotations

import datetime
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

import structlog
import torch

# The store classes are re-exported by torch.distributed at runtime but not in its type stubs.
from torch._C._distributed_c10d import TCPStore

from polyrl_runtime.weights.api import (
    DeltaLink,
    DeltaRejectedError,
    SyncReport,
    WeightManifest,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightTarget,
    check_manifest,
    make_report,
)
from polyrl_runtime.weights.buckets import (
    BucketLayout,
    CopyPlan,
    byte_view,
    layout_for,
    ordered_tensors,
    plan_copies,
    run_copies,
)
from polyrl_runtime.weights.collective_group import (
    CHUNK,
    GroupAddress,
    abort_key,
    await_members,
    broadcast,
    broadcast_ops,
    build_group,
    default_host,
    rank_key,
    wait_work,
)
from polyrl_runtime.weights.delta import DeltaError, make_delta
from polyrl_runtime.weights.delta_chain import encode_link, receive_links
from polyrl_runtime.weights.staging import ALIGN, Staging

log = structlog.get_logger(__name__)

TRANSPORT = "collective"

_Plan = list[tuple[torch.Tensor, CopyPlan | None, int]]


class CollectiveSender(WeightSender):
    transport: ClassVar[str] = TRANSPORT

    def __init__(
        self,
        policy: str,
        bucket_bytes: int,
        *,
        num_receivers: int,
        backend: str | None = None,
        host: str | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = 600.0,
        deltas: int = 0,
    ) -> None:
        super().__init__(policy, bucket_bytes)
        # With deltas: the latest version's host copy, in layout order (the base of the next delta,
        # and what `resend` sends).
        self._deltas = deltas > 0
        self._host: dict[str, torch.Tensor] | None = None
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.host = host or default_host()
        self._store = TCPStore(self.host, 0, None, True, self.timeout, wait_for_workers=False)
        self._generation = 0
        self._num_receivers = num_receivers
        self._group: Any = None
        self._group_generation = -1
        # The tensors of the latest version, in layout order, while they still hold it (see module doc).
        self._source: list[torch.Tensor] | None = None
        self._pack: list[torch.Tensor] = []
        self._plan_key: tuple[object, ...] | None = None
        self._plan: _Plan = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # publish / resend / release_source run on different threads of a trainer actor.
        self._lock = threading.Lock()
        self._abort = threading.Event()

    @property
    def address(self) -> GroupAddress:
        return GroupAddress(
            self.host, self._store.port, self._generation, self._num_receivers + 1, self.backend
        )

    def set_receivers(self, num_receivers: int) -> None:
        """Set the engine count after any membership change (joined, replaced, removed engines).

        Always starts a new group generation, even for an unchanged count: a replaced engine cannot
        rejoin the old group's rank numbering.
        """
        with self._lock:
            self.wait()
            self._renew_if_aborted()
            self._num_receivers = num_receivers
            self._generation += 1

    def _ensure_group(self) -> Any:
        if self._group_generation != self._generation:
            self._group = None
            await_members(
                self._store, self._generation, self._num_receivers, self._abort.is_set, self.timeout
            )
            self._group = build_group(self._store, self.address, 0, self.timeout)
            self._group_generation = self._generation
        return self._group

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightManifest:
        with self._lock:
            self.wait()
            self._renew_if_aborted()
            self._check_version(version)
            layout = layout_for(tensors, min(self.bucket_bytes, CHUNK), align=ALIGN)
            base, previous = self._host, self.latest
            if self._deltas:  # one host copy: the next base, and what this delta is made from
                self._host = {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}
            if (
                base is not None
                and self._host is not None
                and previous is not None
                and _same_tensors(base, tensors)
            ):
                link = encode_link([make_delta(n, base[n], t) for n, t in self._host.items()])
                payload = torch.frombuffer(bytearray(link), dtype=torch.uint8).to(self.device)
                self._source = None  # a resend sends the whole version from the host copy
                delta = DeltaLink(previous.version, version, len(link), None)
                self.latest = WeightManifest(
                    self.policy, version, self.transport, layout, handle=self.address, deltas=(delta,)
                )
                self._start_plan([(piece, None, -1) for piece in _pieces(payload)])
                return self.latest
            self._source = [t.to(self.device) for t in ordered_tensors(layout, tensors)]
            self.latest = WeightManifest(self.policy, version, self.transport, layout, handle=self.address)
            self._start(layout, self._source)
            return self.latest

    def resend(self) -> WeightManifest | None:
        """Broadcast the latest version again (to a group that now includes new engines).

        None when the published tensors may have changed since (`release_source()`): the engines are
        then brought in by the next publish.
        """
        with self._lock:
            self.wait()
            if self.latest is None:
                raise WeightSyncError(f"{self.policy}: nothing published yet")
            source = self._source
            if source is None and self._host is not None:  # deltas: the host copy is the latest
                source = [t.to(self.device) for t in ordered_tensors(self.latest.layout, self._host)]
            if source is None:
                return None
            self._renew_if_aborted()
            self.latest = replace(self.latest, handle=self.address, deltas=())
            self._start(self.latest.layout, source)
            return self.latest

    def release_source(self) -> None:
        """The caller is about to change the published tensors: finish sending them, then forget them.

        A failed send keeps its error for the next `wait()` (the driver's, or the next publish's).
        """
        with self._lock:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            self._source = None

    def abort(self) -> None:
        """Abort the sync in flight, on this side and on every engine of its group (see `_wait`)."""
        self._abort.set()
        for generation in {self._generation, self._group_generation}:
            if generation >= 0:
                self._store.set(abort_key(generation), "1")

    def _renew_if_aborted(self) -> None:
        if self._abort.is_set():
            self._abort.clear()
            self._generation += 1  # the old group's abort key is set: it cannot be used again

    def _start(self, layout: BucketLayout, ordered: list[torch.Tensor]) -> None:
        self._start_plan(self._plan_for(layout, ordered))

    def _start_plan(self, plan: _Plan) -> None:
        self._error = None
        self._thread = threading.Thread(
            target=self._send, args=(plan,), name=f"polyrl-wsync-{self.policy}", daemon=True
        )
        self._thread.start()

    def _plan_for(self, layout: BucketLayout, ordered: list[torch.Tensor]) -> _Plan:
        """The broadcasts of one send. Cached: with a thousand tensors, building the slices
        costs more than the copies, and trainers update their tensors in place. The packing buffers
        change only with the plan."""
        key = (layout, tuple(t.data_ptr() for t in ordered))
        if key == self._plan_key:
            return self._plan
        ops = broadcast_ops(layout)
        need = max((op.nbytes for op in ops if not op.direct), default=0)
        if self._pack and self._pack[0].numel() < need:
            self._pack = []
        if need and not self._pack:
            self._pack = [torch.empty(need, dtype=torch.uint8, device=self.device) for _ in range(2)]
        plan: _Plan = []
        packed = 0
        for op in ops:
            views = [
                byte_view(ordered[s.tensor])[s.src_offset : s.src_offset + s.nbytes] for s in op.segments
            ]
            if op.direct:
                plan.append((views[0], None, -1))
                continue
            slot = packed % 2
            packed += 1
            buf = self._pack[slot]
            pairs = [
                (buf[s.flat_offset - op.offset : s.flat_offset - op.offset + s.nbytes], v)
                for s, v in zip(op.segments, views, strict=True)
            ]
            plan.append((buf[: op.nbytes], plan_copies(pairs), slot))
        self._plan_key, self._plan = key, plan
        return plan

    def _send(self, plan: _Plan) -> None:
        try:
            self._broadcast_plan(plan)
        except BaseException as e:  # re-raised in wait(), on the caller's thread
            # A traceback's frames keep their locals alive, the group and its pending work among them.
            traceback.clear_frames(e.__traceback__)
            self._error = e
            # Drop the failed group now, not at the next sync: that closes its sockets, so an engine
            # still waiting for bytes (gloo stops at the first dead member) fails at once instead of
            # at the timeout. The next sync builds a new generation.
            self._group = None
            self._generation += 1

    def _broadcast_plan(self, plan: _Plan) -> None:
        group = self._ensure_group()
        works = []
        in_use: list[Any] = [None, None]  # the broadcast each packing buffer is on the wire with
        for data, copies, slot in plan:
            if copies is not None:
                if in_use[slot] is not None:
                    wait_work(in_use[slot], self._abort.is_set, self.backend)
                run_copies(copies)
            work = broadcast(group, data)
            works.append(work)
            if slot >= 0:
                in_use[slot] = work
        for w in works:
            wait_work(w, self._abort.is_set, self.backend)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise WeightSyncError(f"{self.policy}: broadcast failed: {err}") from err

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._group = None
            self._source = None
            self._host = None
            self._pack = []
            self._plan_key, self._plan = None, []
            self.latest = None


class CollectiveReceiver(WeightReceiver):
    transport: ClassVar[str] = TRANSPORT

    def __init__(self, device: torch.device | str | None = None, timeout_s: float = 600.0) -> None:
        self._device = torch.device(device) if device is not None else None
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._key: tuple[str, int, int] | None = None
        self._group: Any = None
        self._store: Any = None
        self.rank = -1
        self._staging = Staging()
        # Per (layout object, staging buffer): the slices the broadcasts land in (two buffers alternate).
        self._pieces_cache: list[tuple[BucketLayout, int, list[torch.Tensor]]] = []

    def _pieces(self, layout: BucketLayout, staging: torch.Tensor) -> list[torch.Tensor]:
        for cached_layout, ptr, pieces in self._pieces_cache:
            if cached_layout is layout and ptr == staging.data_ptr():
                return pieces
        pieces = [staging[op.offset : op.offset + op.nbytes] for op in broadcast_ops(layout)]
        self._pieces_cache = [*self._pieces_cache, (layout, staging.data_ptr(), pieces)][-2:]
        return pieces

    def _ensure_group(self, address: GroupAddress) -> Any:
        key = (address.host, address.port, address.generation)
        if key != self._key:
            self._group = None
            if self._store is None or self._key is None or self._key[:2] != key[:2]:
                self._store = TCPStore(address.host, address.port, None, False, self.timeout)
            # Ranks 1..n in arrival order; the sender is rank 0.
            self.rank = int(self._store.add(rank_key(address.generation), 1))
            if self.rank >= address.world_size:
                raise WeightSyncError(
                    f"more engines joined group generation {address.generation} than its "
                    f"{address.world_size - 1} receivers; the sender must set_receivers() first"
                )
            abort = abort_key(address.generation)
            await_members(
                self._store,
                address.generation,
                address.world_size - 1,
                lambda: bool(self._store.check([abort])),
                self.timeout,
            )
            self._group = build_group(self._store, address, self.rank, self.timeout)
            self._key = key
        return self._group

    def receive(self, manifest: WeightManifest, target: WeightTarget) -> SyncReport:
        start = time.perf_counter()
        address: GroupAddress = manifest.handle
        layout = manifest.layout
        rejected: Exception | None = None
        try:
            check_manifest(manifest, target)
        except WeightSyncError as e:
            # Still take part in the broadcast: leaving would hang the sender and the other engines.
            rejected = e
        device = self._device or torch.device("cuda" if address.backend == "nccl" else "cpu")
        if manifest.deltas:
            staging = torch.empty(manifest.deltas[-1].nbytes, dtype=torch.uint8, device=device)
            pieces = _pieces(staging)
        else:
            staging = self._staging.buffer(layout, target, device)
            pieces = self._pieces(layout, staging)
        try:
            group = self._ensure_group(address)
            works = [broadcast(group, piece) for piece in pieces]
            key = abort_key(address.generation)
            for w in works:
                wait_work(w, lambda: bool(self._store.check([key])), address.backend)
        except WeightSyncError as e:
            self._key = None
            raise WeightSyncError(f"{manifest.policy}: version {manifest.version}: {e}") from e
        except Exception as e:
            self._key = None
            raise WeightSyncError(
                f"{manifest.policy}: broadcast of version {manifest.version} failed: {e}"
            ) from e
        if rejected is not None:
            raise rejected
        if manifest.version == target.version:
            return make_report(manifest, start, 0.0, applied=False)
        if staging.device.type == "cuda":
            torch.cuda.synchronize(staging.device)
        if manifest.deltas:
            return _apply_delta(manifest, target, staging, start)
        pause = self._staging.apply(manifest, target, staging)
        return make_report(manifest, start, pause, applied=True)

    def close(self) -> None:
        self._group = None
        self._store = None
        self._key = None
        self._pieces_cache = []
        self._staging.close()


def _same_tensors(base: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> bool:
    return base.keys() == tensors.keys() and all(
        base[n].shape == t.shape and base[n].dtype == t.dtype for n, t in tensors.items()
    )


def _pieces(payload: torch.Tensor) -> list[torch.Tensor]:
    """An encoded delta link cut into broadcasts of at most `CHUNK` bytes (a function of its size)."""
    return [payload[i : i + CHUNK] for i in range(0, payload.numel(), CHUNK)]


def _apply_delta(
    manifest: WeightManifest, target: WeightTarget, payload: torch.Tensor, start: float
) -> SyncReport:
    link = manifest.deltas[-1]
    if target.version != link.base:
        raise DeltaRejectedError(
            f"policy {manifest.policy} version {manifest.version}: sent as deltas from version "
            f"{link.base}, the engine holds {target.version}: it needs the whole version"
        )
    try:
        return receive_links(manifest, [payload.cpu().numpy().tobytes()], target, start, link.nbytes)
    except DeltaError as e:
        raise DeltaRejectedError(
            f"policy {manifest.policy} version {manifest.version}: tensor {e.tensor!r}: {e.reason}; the "
            f"engine keeps version {target.version} and needs the whole version"
        ) from e
