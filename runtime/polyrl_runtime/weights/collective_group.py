"""The process group of the `collective` transport (weights/collective.py) and of vLLM's worker
extension (engines/vllm_worker.py): its address, how members join it and wait for each other, and the
broadcasts a version is cut into (a pure function of the layout)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# The store classes are re-exported by torch.distributed at runtime but not in its type stubs.
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore, Store

from polyrl_runtime.weights.api import WeightSyncError
from polyrl_runtime.weights.buckets import BucketLayout, Segment

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# The layout's bucket size, so that no broadcast and no packing buffer exceeds it.
CHUNK = 16 << 20
# Pieces of at least this many bytes are broadcast straight from the tensor. Smaller ones are packed:
# every broadcast is a round of messages between the processes.
DIRECT_MIN = 1 << 20


@dataclass(frozen=True)
class GroupAddress:
    host: str
    port: int
    generation: int
    world_size: int
    backend: str  # "gloo" | "nccl"


def default_host() -> str:
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


@dataclass(frozen=True)
class BroadcastOp:
    """One broadcast: flat bytes [offset, offset + nbytes), holding `segments`.

    Direct ops hold one large segment, sent from the tensor itself; the others hold small segments
    (and any alignment padding between them), packed on the sender.
    """

    offset: int
    nbytes: int
    segments: tuple[Segment, ...]
    direct: bool


def broadcast_ops(layout: BucketLayout, direct_min: int = DIRECT_MIN) -> list[BroadcastOp]:
    """The broadcasts of one version, in order; sender and receivers derive the same list.

    Never spans buckets: a packing buffer of one bucket's size always suffices.
    """
    ops: list[BroadcastOp] = []
    for bucket in layout.buckets:
        run: list[Segment] = []
        for seg in (*bucket.segments, None):
            if seg is not None and seg.nbytes < direct_min:
                run.append(seg)
                continue
            if run:
                start, end = run[0].flat_offset, run[-1].flat_offset + run[-1].nbytes
                ops.append(BroadcastOp(start, end - start, tuple(run), direct=False))
                run = []
            if seg is not None:
                ops.append(BroadcastOp(seg.flat_offset, seg.nbytes, (seg,), direct=True))
    return ops


def broadcast(group: Any, t: torch.Tensor) -> Any:
    opts = BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([t], opts)


# How often a gloo member waiting for bytes checks whether the sync was aborted.
_POLL = datetime.timedelta(seconds=0.1)


def abort_key(generation: int) -> str:
    """The store key the sender sets to abort the syncs of a group generation."""
    return f"polyrl/weights/g{generation}/abort"


def rank_key(generation: int) -> str:
    """The store counter engines take their ranks (1..n) from."""
    return f"polyrl/weights/g{generation}/rank"


def await_members(
    store: Store, generation: int, receivers: int, aborted: Callable[[], bool], timeout: datetime.timedelta
) -> None:
    """Wait until all `receivers` engines of a generation have taken their ranks, giving up when
    `aborted()` says so.

    Building a group is a rendezvous that waits for every member, and cannot be interrupted: a member
    that died before joining held everyone else there for the whole timeout (minutes), and the
    sender's store client with them, so even the abort could not be sent. Members that have taken
    their ranks are alive and joining; building the group then takes milliseconds.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while (joined := int(store.add(rank_key(generation), 0))) < receivers:
        if aborted():
            raise WeightSyncError(f"the sync was aborted while engines joined group generation {generation}")
        if time.monotonic() > deadline:
            raise WeightSyncError(
                f"{joined} of {receivers} engines joined group generation {generation} "
                f"within {timeout.total_seconds():g} s"
            )
        time.sleep(0.002)


def wait_work(work: Any, aborted: Callable[[], bool], backend: str) -> None:
    """Wait for one broadcast; on gloo, give up when `aborted()` says so.

    gloo forwards a broadcast through its members, so one that died can leave the others waiting
    for bytes that never come, until the group's timeout (minutes). They cannot tell; the driver
    can (the dead engine's call fails) and asks the sender to abort. A wait with a timeout leaves
    the operation running, and dropping the group afterwards closes it. NCCL waits on the GPU
    stream, not here: its hangs are left to its own timeout.
    """
    if backend != "gloo":
        work.wait()
        return
    while True:
        try:
            work.wait(_POLL)
            return
        except RuntimeError as e:
            # Only the slice ran out (c10d's message for a wait's own timeout). The operation may
            # have ended just after: the next wait returns at once, or raises its error.
            if "Operation timed out!" not in str(e):
                raise  # the operation itself failed
        if aborted():
            raise WeightSyncError("the sync was aborted (an engine of the group died)")


# Per broadcast: the bytes to send, the copies that pack them (None: sent as it is), the packing
# buffer (-1: none).
