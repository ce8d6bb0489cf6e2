"""The `cudaipc` handle: what an engine needs to map a trainer's tensors, and torch's CUDA IPC calls.

A handle names the sender's GPU by UUID, its process and sender, its guard file, and the storages it
shares: each as the arguments of torch's `rebuild_cuda_tensor` for a flat uint8 tensor over the whole
storage (`share_storage`), which `map_storages` opens in the engine. Tensors are byte offsets into
those storages (`locations`). The protocol around them (the guard, torch's counters, what a sender
shares and when) is in `cudaipc.py`.

`handle_args` / `handle_from_args` carry a handle as plain values (strings, numbers, bytes, lists),
for an RPC that carries no classes: vLLM's `collective_rpc` (see `engines/vllm_worker.py`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from polyrl_runtime.weights.api import WeightSyncError

# Positions in the arguments of torch's `rebuild_cuda_tensor` (what `reduce_tensor` returns).
_ARGS = 15
_SIZE, _STRIDE, _DEVICE = 1, 2, 6
_REF_COUNTER, _REF_COUNTER_OFFSET, _EVENT_SYNC = 11, 12, 14
# The arguments that are classes, not values: the same in every share (a flat uint8 tensor over a
# typed storage), so `handle_args` leaves them out and `handle_from_args` puts them back.
_CLASSES: dict[int, object] = {0: torch.Tensor, 4: torch.storage.TypedStorage, 5: torch.uint8}
_UNKNOWN_FORM = "this torch shares CUDA tensors in a form cudaipc does not know"

# Tells a receiver whether a handle comes from its own process; the pid keeps a forked child apart.
_BOOT = uuid.uuid4().hex


def this_process() -> str:
    return f"{os.getpid()}-{_BOOT}"


@dataclass(frozen=True)
class CudaIpcHandle:
    device_uuid: str
    """The sender's GPU (`torch.cuda.get_device_properties(...).uuid`); "" when nothing has bytes."""
    process: str
    sender: str
    guard: str
    """Path of the sender's `ServeGuard`."""
    storages: tuple[tuple[Any, ...], ...]
    """`rebuild_cuda_tensor` arguments of each shared storage, as a flat uint8 tensor."""
    locations: tuple[tuple[int, int], ...]
    """Per tensor in layout order: (index into `storages`, byte offset); (-1, 0) for no bytes."""


def handle_args(handle: CudaIpcHandle) -> dict[str, Any]:
    """`handle` as plain values; `handle_from_args` rebuilds it."""
    storages = []
    for args in handle.storages:
        if len(args) != _ARGS or any(args[i] is not fixed for i, fixed in _CLASSES.items()):
            raise WeightSyncError(_UNKNOWN_FORM)
        storages.append(
            [None if i in _CLASSES else list(a) if isinstance(a, tuple) else a for i, a in enumerate(args)]
        )
    return {
        "device_uuid": handle.device_uuid,
        "process": handle.process,
        "sender": handle.sender,
        "guard": handle.guard,
        "storages": storages,
        "locations": [list(location) for location in handle.locations],
    }


def handle_from_args(args: Mapping[str, Any]) -> CudaIpcHandle:
    storages = []
    for plain in args["storages"]:
        if len(plain) != _ARGS:
            raise WeightSyncError(f"a cudaipc storage has {len(plain)} arguments, not torch's {_ARGS}")
        # An RPC's decoder may hand bytes back as another buffer type; torch takes bytes.
        full: list[Any] = [
            _CLASSES.get(i, bytes(a) if isinstance(a, bytearray | memoryview) else a)
            for i, a in enumerate(plain)
        ]
        full[_SIZE], full[_STRIDE] = torch.Size(plain[_SIZE]), tuple(plain[_STRIDE])
        storages.append(tuple(full))
    return CudaIpcHandle(
        str(args["device_uuid"]),
        str(args["process"]),
        str(args["sender"]),
        str(args["guard"]),
        tuple(storages),
        tuple((int(i), int(offset)) for i, offset in args["locations"]),
    )


@dataclass(frozen=True)
class StorageShare:
    """A storage shared for one version: the alias torch registered, and its consumer count."""

    alias: object
    ref_counter: bytes
    ref_counter_offset: int


def share_storage(
    policy: str, name: str, storage: torch.UntypedStorage, counters: bytes
) -> tuple[tuple[Any, ...], StorageShare]:
    """CUDA IPC arguments of `storage` as one flat uint8 tensor, shared through a non-owning alias;
    engines return their counts to the shared-memory file `counters` (a `CounterSink`, see
    `cudaipc.py`)."""
    alias = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), storage.device, storage.nbytes()
    )
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(alias)
    try:
        rebuild, args = reduce_tensor(flat)  # type: ignore[no-untyped-call]
    except RuntimeError as e:
        raise WeightSyncError(
            f"{policy}: cannot share the memory of tensor {name!r} through CUDA IPC: {e}"
        ) from e
    if rebuild is not rebuild_cuda_tensor or len(args) != _ARGS:
        raise WeightSyncError(f"{policy}: {_UNKNOWN_FORM}")
    share = StorageShare(alias, args[_REF_COUNTER], int(args[_REF_COUNTER_OFFSET]))
    # The sender synchronizes its device before the manifest exists, so engines need not wait on
    # torch's interprocess event (each wait would open, and keep, an event handle in the engine).
    for_engines = (
        *args[:_REF_COUNTER],
        counters,
        0,
        *args[_REF_COUNTER_OFFSET + 1 : _EVENT_SYNC],
        False,
    )
    return for_engines, share


def map_storages(policy: str, handle: CudaIpcHandle, device: int) -> list[torch.Tensor]:
    """Each shared storage as a flat uint8 tensor on local device `device` (an IPC mapping each)."""
    out: list[torch.Tensor] = []
    for args in handle.storages:
        local = list(args)
        local[_DEVICE] = device  # the trainer's index of the GPU may differ from this process's
        try:
            out.append(rebuild_cuda_tensor(*local))  # type: ignore[no-untyped-call]
        except RuntimeError as e:
            raise WeightSyncError(
                f"{policy}: cannot map the trainer's GPU memory through CUDA IPC: {e}"
            ) from e
    return out
