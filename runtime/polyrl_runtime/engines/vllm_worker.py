"""The vLLM worker extension: weight versions from the job's collective or cudaipc transport, handed
to the served model bucket by bucket.

vLLM mixes `PolyrlWorkerExtension` into every GPU worker (`worker_extension_cls`); the engine actor
calls its methods by name through `AsyncLLM.collective_rpc`, with plain arguments only (numbers,
strings, bytes), so neither callables nor tensors cross vLLM's RPC and
`VLLM_ALLOW_INSECURE_SERIALIZATION` stays off.

Why not vLLM's own weight-transfer engines (`vllm.distributed.weight_transfer`): their trainer side is
vLLM code (`NCCLWeightTransferEngine.trainer_send_weights` on a `StatelessProcessGroup`), while this
job's trainers publish through `polyrl_runtime.weights`' collective sender, which also serves the torch
engine, CPU jobs (gloo) and late joiners (`resend`). Receiving that sender's broadcasts here keeps one
trainer-side protocol for every engine and no vLLM on trainer pods.

Per sync the tensor-parallel rank 0 worker joins the sender's group (the same rank counter and
rendezvous as `CollectiveReceiver`) and receives the broadcasts of `broadcast_ops(layout)`; with TP > 1
it forwards each piece to the other ranks over vLLM's TP group. Pieces land in per-tensor buffers (a
large piece straight into its tensor's buffer, packed small tensors through one chunk-sized scratch
buffer); each complete tensor joins a batch handed to the model's `load_weights`, which maps the
trainer's (Hugging Face) names onto vLLM's fused and sharded parameters, once about a bucket is ready.
So the extra GPU memory is about one bucket plus the largest tensor, never a staging copy of the model.

A `cudaipc` version (a rollout colocated with its trainer: one pool of one pod) is read where the
trainer holds it: every worker maps the trainer's storages itself through `CudaIpcReceiver.read` (the
engine's workers are processes of the trainer's pod, so on its host, where CUDA IPC works), holds the
trainer's guard shared meanwhile, and hands views of the trainer's tensors to `load_weights` about a
bucket at a time: no buffer, no staging copy, and no piece crosses the TP group (each rank's
`load_weights` takes the full tensors and keeps its shard, as with the collective path).

Invariant: nothing is written into the served parameters before every rank has joined (collective) or
the layout is checked against the handle and the version found still served (cudaipc); once
`load_weights` has run, a failure leaves the model mixed, which the caller learns from `WeightsWritten`
(the engine then retires itself, see `vllm_engine.py`).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
from torch._C._distributed_c10d import TCPStore

from polyrl_runtime.engines import vllm_api
from polyrl_runtime.weights.api import WeightManifest, WeightSyncError
from polyrl_runtime.weights.buckets import BucketLayout, TensorSpec, byte_view, plan_buckets
from polyrl_runtime.weights.collective_group import (
    CHUNK,
    GroupAddress,
    abort_key,
    await_members,
    broadcast,
    broadcast_ops,
    build_group,
    rank_key,
    wait_work,
)
from polyrl_runtime.weights.cudaipc import TRANSPORT as CUDAIPC
from polyrl_runtime.weights.cudaipc import CudaIpcReceiver, MappedVersion
from polyrl_runtime.weights.cudaipc_handle import handle_from_args
from polyrl_runtime.weights.staging import ALIGN

log = structlog.get_logger(__name__)

Load = Callable[[list[tuple[str, torch.Tensor]]], Any]
# Forwards one received piece from TP rank 0 to the other TP ranks (in place on every rank).
Forward = Callable[[torch.Tensor], None]


class WeightsWritten(WeightSyncError):
    """A sync failed after some tensors went into the served model: its weights are mixed."""


def layout_args(layout: BucketLayout, align: int = ALIGN) -> dict[str, Any]:
    """A layout as plain values for `collective_rpc` (vLLM's RPC carries no custom classes). `align`:
    the one the sender planned it with (`ALIGN` for the collective transport's, `LAYOUT_ALIGN` for
    cudaipc's)."""
    return {
        "digest": layout.wire[0],
        "bucket_bytes": layout.bucket_bytes,
        "align": align,
        "specs": [(s.name, list(s.shape), str(s.dtype).removeprefix("torch.")) for s in layout.specs],
    }


def layout_from_args(args: dict[str, Any]) -> BucketLayout:
    """Rebuild the sender's layout (`plan_buckets` is a pure function of specs, bucket size and
    alignment) and check it against the sender's digest, so both sides cut the same broadcasts."""
    specs = []
    for name, shape, dtype in args["specs"]:
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise WeightSyncError(f"tensor {name!r}: unknown dtype {dtype!r}")
        specs.append(TensorSpec(name, tuple(int(d) for d in shape), dt))
    layout = plan_buckets(specs, int(args["bucket_bytes"]), int(args["align"]))
    if layout.wire[0] != args["digest"]:
        raise WeightSyncError("the rebuilt bucket layout differs from the sender's (digest mismatch)")
    return layout


def address_args(address: GroupAddress) -> dict[str, Any]:
    return {
        "host": address.host,
        "port": address.port,
        "generation": address.generation,
        "world_size": address.world_size,
        "backend": address.backend,
    }


@dataclass
class _Assembly:
    """Per-tensor buffers filled piece by piece; complete tensors go to `load` about a bucket at a time."""

    layout: BucketLayout
    load: Load
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    got: dict[int, int] = field(default_factory=dict)
    ready: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    ready_bytes: int = 0
    loaded_tensors: int = 0
    load_calls: int = 0
    touched: bool = False

    def buffer(self, index: int) -> torch.Tensor:
        buf = self.buffers.get(index)
        if buf is None:
            spec = self.layout.specs[index]
            buf = self.buffers[index] = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            self.got[index] = 0
        return buf

    def landed(self, index: int, nbytes: int) -> None:
        self.got[index] += nbytes
        if self.got[index] == self.layout.specs[index].nbytes:
            del self.got[index]
            self.add(index, self.buffers.pop(index))

    def add(self, index: int, tensor: torch.Tensor) -> None:
        """Tensor `index` of the layout is complete: it goes with the next batch."""
        spec = self.layout.specs[index]
        self.ready.append((spec.name, tensor))
        self.ready_bytes += spec.nbytes
        if self.ready_bytes >= self.layout.bucket_bytes:
            self.flush()

    def flush(self) -> None:
        if self.ready:
            batch, self.ready, self.ready_bytes = self.ready, [], 0
            self.touched = True  # from here on, a failure may have written part of the model
            self.load(batch)
            self.loaded_tensors += len(batch)
            self.load_calls += 1


def stream_version(
    layout: BucketLayout,
    receive: Callable[[torch.Tensor], None] | None,
    load: Load,
    device: torch.device,
    forward: Forward | None = None,
) -> int:
    """Receive one version's broadcasts and load them tensor batch by batch; returns `load` calls.

    `receive(piece)` fills a byte tensor from the sender (TP rank 0; None on the other ranks, which
    get every piece from `forward`). Raises `WeightsWritten` when a failure comes after a `load`.
    """
    asm = _Assembly(layout, load, device)
    scratch = torch.empty(0, dtype=torch.uint8, device=device)
    with _written_if_loaded(asm):
        for op in broadcast_ops(layout):
            if op.direct:
                seg = op.segments[0]
                dest = byte_view(asm.buffer(seg.tensor))[seg.src_offset : seg.src_offset + seg.nbytes]
            else:
                if scratch.numel() < op.nbytes:
                    scratch = torch.empty(
                        max(op.nbytes, min(CHUNK, layout.bucket_bytes)), dtype=torch.uint8, device=device
                    )
                dest = scratch[: op.nbytes]
            if receive is not None:
                receive(dest)
            if forward is not None:
                forward(dest)
            for seg in op.segments:
                if not op.direct:
                    src = dest[seg.flat_offset - op.offset : seg.flat_offset - op.offset + seg.nbytes]
                    byte_view(asm.buffer(seg.tensor))[seg.src_offset : seg.src_offset + seg.nbytes].copy_(src)
                asm.landed(seg.tensor, seg.nbytes)
        asm.flush()
    if asm.buffers:
        missing = sorted(layout.specs[i].name for i in asm.buffers)
        raise WeightsWritten(f"tensors incomplete after the last broadcast: {missing[:5]}")
    return asm.load_calls


def load_mapped(mapped: MappedVersion, load: Load, devices: Iterable[torch.device]) -> int:
    """Hand a cudaipc version's tensors, views of the trainer's memory, to `load` about a bucket at a
    time, then check the trainer served them throughout (`devices`: where `load` writes); returns
    `load` calls. Raises `WeightsWritten` when a failure comes after a `load`."""
    asm = _Assembly(mapped.manifest.layout, load)
    with _written_if_loaded(asm):
        for index in range(len(mapped.manifest.layout.specs)):
            asm.add(index, mapped.tensor(index))
        asm.flush()
        mapped.finish(devices)
    return asm.load_calls


@contextlib.contextmanager
def _written_if_loaded(asm: _Assembly) -> Iterator[None]:
    """A failure as a `WeightSyncError`: `WeightsWritten` once a `load` has begun."""
    try:
        yield
    except WeightSyncError as e:
        if asm.touched:
            raise WeightsWritten(f"{e} (after {asm.loaded_tensors} tensors were loaded)") from e
        raise
    except Exception as e:
        if asm.touched:
            raise WeightsWritten(
                f"{type(e).__name__}: {e} (after {asm.loaded_tensors} tensors were loaded)"
            ) from e
        raise WeightSyncError(f"{type(e).__name__}: {e}") from e


@dataclass
class GroupMember:
    """This worker's membership in the sender's group (rebuilt when the generation changes)."""

    timeout: datetime.timedelta
    key: tuple[str, int, int] | None = None
    store: Any = None
    group: Any = None
    rank: int = -1

    def join(self, address: GroupAddress) -> Any:
        key = (address.host, address.port, address.generation)
        if key == self.key:
            return self.group
        self.group = None
        if self.store is None or self.key is None or self.key[:2] != key[:2]:
            log.info("vllm.weights.connect", host=address.host, port=address.port)
            self.store = TCPStore(address.host, address.port, None, False, self.timeout)
        self.rank = int(self.store.add(rank_key(address.generation), 1))
        if self.rank >= address.world_size:
            raise WeightSyncError(
                f"more engines joined group generation {address.generation} than its "
                f"{address.world_size - 1} receivers"
            )
        abort = abort_key(address.generation)
        log.info("vllm.weights.await_members", generation=address.generation, members=address.world_size)
        await_members(
            self.store,
            address.generation,
            address.world_size - 1,
            lambda: bool(self.store.check([abort])),
            self.timeout,
        )
        self.group = build_group(self.store, address, self.rank, self.timeout)
        self.key = key
        return self.group

    def receiver(self, address: GroupAddress) -> Callable[[torch.Tensor], None]:
        """`receive` for `stream_version`: one broadcast from the sender into the piece. A gloo piece
        travels through a host buffer when the piece lives on the GPU."""
        group = self.join(address)
        abort = abort_key(address.generation)

        def receive(piece: torch.Tensor) -> None:
            landing = (
                piece
                if address.backend == "nccl" or piece.device.type == "cpu"
                else torch.empty_like(piece, device="cpu")
            )
            try:
                wait_work(broadcast(group, landing), lambda: bool(self.store.check([abort])), address.backend)
            except Exception:
                self.key = None  # a failed group is not reused
                raise
            if landing is not piece:
                piece.copy_(landing)

        return receive


def covered(loaded: Iterable[str], params: Sequence[str]) -> list[str]:
    """Served parameters that no `load_weights` call of a version reported loading."""
    done = set(loaded)
    return [p for p in params if p not in done]


@dataclass
class ModelLoad:
    """`load` into the served model for one version: batches go to its `load_weights`, which maps the
    trainer's names onto vLLM's parameters and reports the ones it loaded."""

    model: Any
    apply: bool = True
    loaded: set[str] = field(default_factory=set)
    reported: bool = True  # every load_weights call returned the names it loaded
    calls: int = 0

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        if not self.apply:
            return
        self.calls += 1
        names = self.model.load_weights(weights=batch)
        if names is None:
            self.reported = False
        else:
            self.loaded.update(names)

    def check_covered(self) -> None:
        """Every served parameter was loaded (when `load_weights` says which it loads)."""
        if not (self.apply and self.reported):
            return
        missing = covered(self.loaded, [n for n, _ in self.model.named_parameters()])
        if missing:
            error = WeightsWritten if self.calls else WeightSyncError
            raise error(
                f"the update did not cover {len(missing)} served parameters, e.g. {missing[:3]} "
                "(the trainer's tensor names do not match this model)"
            )


def _as_result(receive: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A receive's outcome as values, `written` saying whether it touched the served weights (vLLM's
    RPC would carry an exception only as text): the engine learns a model is mixed when any worker
    failed and any worker, that one or another TP rank, wrote."""
    try:
        return receive()
    except WeightsWritten as e:
        log.error("vllm.weights.mixed", error=str(e))
        return {"error": str(e), "written": True}
    except Exception as e:
        log.warning("vllm.weights.failed", error=str(e))
        return {"error": f"{type(e).__name__}: {e}", "written": False}


class PolyrlWorkerExtension:
    """Mixed into vLLM's GPU worker; every method is called on all workers by `collective_rpc`.

    Names start with `polyrl_` (vLLM refuses extension attributes that clash with the worker's).
    """

    model_runner: Any  # set by vLLM's Worker, the class this is mixed into

    def polyrl_receive_version(
        self, address: dict[str, Any], layout: dict[str, Any], timeout_s: float = 600.0, apply: bool = True
    ) -> dict[str, Any]:
        """Receive one version of the collective transport (`apply=False`: take part in the
        broadcast, load nothing); errors come back as values (`_as_result`)."""
        return _as_result(lambda: self._polyrl_receive(address, layout, timeout_s, apply))

    def _polyrl_receive(
        self, address: dict[str, Any], layout: dict[str, Any], timeout_s: float, apply: bool
    ) -> dict[str, Any]:
        tp = vllm_api.load("get_tp_group")()
        state: GroupMember | None = getattr(self, "_polyrl_member", None)
        if state is None or state.timeout.total_seconds() != timeout_s:
            state = GroupMember(datetime.timedelta(seconds=timeout_s))
            self._polyrl_member = state
        addr = GroupAddress(**address)
        plan = layout_from_args(layout)
        load = ModelLoad(self.model_runner.get_model(), apply)
        device = torch.device("cuda", torch.cuda.current_device())
        receive = state.receiver(addr) if tp.rank_in_group == 0 else None
        forward: Forward | None = None
        if tp.world_size > 1:

            def forward(piece: torch.Tensor) -> None:
                tp.broadcast(piece, src=0)

        calls = stream_version(plan, receive, load, device, forward)
        torch.cuda.synchronize(device)
        load.check_covered()
        return {
            "load_calls": calls,
            "tensors": len(plan.specs) if apply else 0,
            "written": load.calls > 0,
            "rank": tp.rank_in_group,
        }

    def polyrl_receive_ipc(
        self,
        policy: str,
        version: int,
        handle: dict[str, Any],
        layout: dict[str, Any],
        timeout_s: float = 600.0,
    ) -> dict[str, Any]:
        """Load one version of the cudaipc transport from the trainer's memory (`handle_args`,
        `layout_args`); `timeout_s` bounds the wait for the trainer's guard. Errors come back as values
        (`_as_result`)."""
        return _as_result(lambda: self._polyrl_receive_ipc(policy, version, handle, layout, timeout_s))

    def _polyrl_receive_ipc(
        self, policy: str, version: int, handle: dict[str, Any], layout: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        plan = layout_from_args(layout)
        manifest = WeightManifest(policy, int(version), CUDAIPC, plan, handle_from_args(handle))
        receiver: CudaIpcReceiver | None = getattr(self, "_polyrl_ipc", None)
        if receiver is None:
            receiver = self._polyrl_ipc = CudaIpcReceiver(timeout_s)
        receiver.timeout_s = timeout_s
        load = ModelLoad(self.model_runner.get_model())
        # Where load_weights writes: this worker's device (none on a machine without CUDA).
        devices = [torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_available() else []
        with receiver.read(manifest) as mapped:
            calls = load_mapped(mapped, load, devices)
        load.check_covered()
        return {"load_calls": calls, "tensors": len(plan.specs), "written": load.calls > 0}

    def polyrl_device_memory(self) -> dict[str, int]:
        """Bytes in use on this worker's GPU, by every process on it (what a sleep frees shows here;
        vLLM's sleep reports its figure only in its log)."""
        free, total = torch.cuda.mem_get_info()
        return {"used": int(total - free)}
