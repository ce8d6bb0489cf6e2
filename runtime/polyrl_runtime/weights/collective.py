"""`collective` transport: a dedicated torch.distributed group, gloo on CPU and NCCL on GPU.

The group is *not* the default process group: the trainer may already run DeepSpeed in its own
default group, and engines (vLLM) in theirs. As vLLM's `StatelessProcessGroup` does, the sender (rank
0) hosts its own `TCPStore`, and a `ProcessGroupGloo`/`ProcessGroupNCCL` is built directly on a
`PrefixStore` of it. Engines learn the address from the manifest and take ranks 1..n from a counter in
the store, so no rank assignment has to be planned ahead. When the set of engines changes (scale-out,
a restarted engine) the sender bumps the group *generation*; the next manifest names it and everyone
builds the new group lazily.

Data: the version is cut into chunks of at most `CHUNK` bytes (smaller than a bucket, so that even a
one-bucket model pipelines) and the sender packs chunk i+1 while chunk i is being broadcast (the
broadcast runs on the backend's threads / NCCL's stream). It packs into a persistent flat buffer that
keeps the latest version, so a late joiner can be served by `resend()` without the trainer's (by then
changed) parameters. Receivers broadcast into a staging buffer and only then, after every chunk
arrived and the manifest matched, apply it (see `staging.py`: a swap of the engine's tensors to views
of the buffer where the target allows, else a copy): a failed or mismatched transfer leaves the engine
on its old version.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import structlog
import torch
import torch.distributed as dist

# The store classes are re-exported by torch.distributed at runtime but not in its type stubs.
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore, Store, TCPStore

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

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Pipelining granularity (packing chunk i+1 overlaps broadcasting chunk i).
CHUNK = 16 << 20


@dataclass(frozen=True)
class GroupAddress:
    host: str
    port: int
    generation: int
    world_size: int
    backend: str  # "gloo" | "nccl"


def _default_host() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except ImportError:  # pragma: no cover - ray is a dependency, but the transport does not need it
        pass
    return "127.0.0.1"


def build_group(store: Store, address: GroupAddress, rank: int, timeout: datetime.timedelta) -> Any:
    """A process group of `address.world_size` ranks on its own store prefix, outside the default group."""
    prefix = PrefixStore(f"polyrl/weights/g{address.generation}", store)
    if address.backend == "gloo":
        # `_Options` (devices, threads, timeout) is missing from torch's stubs; vLLM uses it too.
        opts: Any = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009
        opts._timeout = timeout
        opts._threads = 2
        # On loopback, bind loopback explicitly: the default device resolves the hostname, which in
        # containers may name an interface other processes on this host cannot reach.
        if address.host in _LOOPBACK:
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address.host)]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(prefix, rank, address.world_size, opts)
    if address.backend == "nccl":
        # Absent from CPU builds of torch, hence the lookup by name.
        nccl: Any = getattr(dist, "ProcessGroupNCCL")  # noqa: B009
        nccl_opts = nccl.Options()
        nccl_opts._timeout = timeout
        return nccl(prefix, rank, address.world_size, nccl_opts)
    raise ValueError(f"unknown collective backend {address.backend!r}")


def _broadcast(group: Any, t: torch.Tensor) -> Any:
    opts = BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([t], opts)


class CollectiveSender(WeightSender):
    transport: ClassVar[str] = "collective"

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
    ) -> None:
        super().__init__(policy, bucket_bytes)
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.host = host or _default_host()
        self._store = TCPStore(self.host, 0, None, True, self.timeout, wait_for_workers=False)
        self._generation = 0
        self._num_receivers = num_receivers
        self._group: Any = None
        self._group_generation = -1
        self._flat: torch.Tensor | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pairs = PairCache()

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
        self.wait()
        self._num_receivers = num_receivers
        self._generation += 1

    def _ensure_group(self) -> Any:
        if self._group_generation != self._generation:
            self._group = None
            self._group = build_group(self._store, self.address, 0, self.timeout)
            self._group_generation = self._generation
        return self._group

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightManifest:
        self.wait()
        self._check_version(version)
        layout = layout_for(tensors, min(self.bucket_bytes, CHUNK), align=ALIGN)
        ordered = [t.to(self.device) for t in ordered_tensors(layout, tensors)]
        if self._flat is None or self._flat.numel() < layout.total_bytes:
            self._flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=self.device)
        self.latest = WeightManifest(self.policy, version, self.transport, layout, handle=self.address)
        self._start(layout, ordered)
        return self.latest

    def resend(self) -> WeightManifest:
        """Broadcast the latest version again (to a group that now includes new engines)."""
        self.wait()
        if self.latest is None:
            raise WeightSyncError(f"{self.policy}: nothing published yet")
        self.latest = replace(self.latest, handle=self.address)
        self._start(self.latest.layout, None)
        return self.latest

    def _start(self, layout: BucketLayout, ordered: list[torch.Tensor] | None) -> None:
        self._error = None
        self._thread = threading.Thread(
            target=self._send, args=(layout, ordered), name=f"polyrl-wsync-{self.policy}", daemon=True
        )
        self._thread.start()

    def _send(self, layout: BucketLayout, ordered: list[torch.Tensor] | None) -> None:
        try:
            group = self._ensure_group()
            flat = self._flat
            assert flat is not None
            works = []
            per_bucket = (
                self._pairs.per_bucket(layout, ordered, flat, into_flat=True) if ordered is not None else None
            )
            for bucket in layout.buckets:
                if per_bucket is not None:
                    copy_pairs(per_bucket[bucket.index])
                works.append(_broadcast(group, flat[bucket.offset : bucket.offset + bucket.nbytes]))
            for w in works:
                w.wait()
            if flat.device.type == "cuda":
                torch.cuda.synchronize(flat.device)
        except BaseException as e:  # re-raised in wait(), on the caller's thread
            self._error = e
            # A failed collective leaves the group unusable; the next sync builds a fresh one.
            self._generation += 1

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
            self._flat = None
            self.latest = None


class CollectiveReceiver(WeightReceiver):
    transport: ClassVar[str] = "collective"

    def __init__(self, device: torch.device | str | None = None, timeout_s: float = 600.0) -> None:
        self._device = torch.device(device) if device is not None else None
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._key: tuple[str, int, int] | None = None
        self._group: Any = None
        self._store: Any = None
        self.rank = -1
        self._staging = Staging()

    def _ensure_group(self, address: GroupAddress) -> Any:
        key = (address.host, address.port, address.generation)
        if key != self._key:
            self._group = None
            if self._store is None or self._key is None or self._key[:2] != key[:2]:
                self._store = TCPStore(address.host, address.port, None, False, self.timeout)
            # Ranks 1..n in arrival order; the sender is rank 0.
            self.rank = int(self._store.add(f"polyrl/weights/g{address.generation}/rank", 1))
            if self.rank >= address.world_size:
                raise WeightSyncError(
                    f"more engines joined group generation {address.generation} than its "
                    f"{address.world_size - 1} receivers; the sender must set_receivers() first"
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
        staging = self._staging.buffer(layout, target, device)
        try:
            group = self._ensure_group(address)
            works = [_broadcast(group, staging[b.offset : b.offset + b.nbytes]) for b in layout.buckets]
            for w in works:
                w.wait()
        except WeightSyncError:
            self._key = None
            raise
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
        pause = self._staging.apply(manifest, target, staging)
        return make_report(manifest, start, pause, applied=True)

    def close(self) -> None:
        self._group = None
        self._store = None
        self._key = None
        self._staging.close()
