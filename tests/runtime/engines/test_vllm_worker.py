"""The vLLM worker extension's receive paths on CPU, without vLLM: the trainer's real collective sender
(gloo), the extension's group membership and bucket streaming, into a torch model's loader; and of the
cudaipc path what needs no CUDA (plain RPC values, refusals, batching of mapped tensors).

vLLM's part (its `load_weights`, its TP group) needs a GPU (test_vllm_engine.py); here a module's
`copy_` loader stands for `load_weights`, and a second gloo group for the TP group. The cudaipc path
mapping a trainer's GPU memory: tests/runtime/gpu/test_vllm_worker_cudaipc.py.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from polyrl_runtime.engines.vllm_worker import (
    GroupMember,
    ModelLoad,
    PolyrlWorkerExtension,
    WeightsWritten,
    address_args,
    layout_args,
    layout_from_args,
    load_mapped,
    stream_version,
)
from polyrl_runtime.weights import make_sender
from polyrl_runtime.weights.api import WeightManifest, WeightSyncError
from polyrl_runtime.weights.buckets import BucketLayout, byte_view, layout_for
from polyrl_runtime.weights.collective_group import GroupAddress, broadcast, build_group
from polyrl_runtime.weights.cudaipc import LAYOUT_ALIGN, MappedVersion
from polyrl_runtime.weights.cudaipc_handle import CudaIpcHandle, handle_args, handle_from_args
from polyrl_runtime.weights.serve_guard import ServeGuard
from polyrl_runtime.weights.staging import ALIGN

BUCKET = 2 << 20
SHAPES = {
    "embed.weight": ((1024, 768), torch.float32),  # 3 MiB: spans buckets
    "mlp.weight": ((512, 768), torch.float32),  # 1.5 MiB: broadcast straight into its buffer
    **{f"layers.{i}.weight": ((512, 512), torch.float32) for i in range(4)},  # 1 MiB each
    "norm.weight": ((768,), torch.float32),
    "head.bias": ((7,), torch.bfloat16),
    "step": ((1,), torch.int64),
}


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: (torch.randn(s, generator=g) * 10).to(d)
        if d.is_floating_point
        else torch.randint(0, 99, s, generator=g)
        for n, (s, d) in SHAPES.items()
    }


class Loader:
    """A model's `load_weights` stand-in: copies each named tensor into its parameter."""

    def __init__(self, fail_at: int = -1) -> None:
        self.params = {n: torch.zeros(s, dtype=d) for n, (s, d) in SHAPES.items()}
        self.batches: list[list[str]] = []
        self.fail_at = fail_at

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        if len(self.batches) == self.fail_at:
            raise RuntimeError("load failed")
        self.batches.append([n for n, _ in batch])
        for name, t in batch:
            self.params[name].copy_(t)


def _run(fns: list[Callable[[], object]]) -> list[object]:
    out: list[object] = [None] * len(fns)

    def go(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:
            out[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def _join_and_stream(member: GroupMember, address: GroupAddress, layout: BucketLayout, load: Loader) -> int:
    """One engine's side of a sync, as the worker extension runs it (joining waits for the others)."""
    return stream_version(layout, member.receiver(address), load, torch.device("cpu"))


def test_two_engines_stream_a_version_into_their_models_bucket_by_bucket() -> None:
    sender = make_sender("collective", "p", BUCKET, num_receivers=2, host="127.0.0.1", timeout_s=60.0)
    members = [GroupMember(datetime.timedelta(seconds=60)) for _ in range(2)]
    loaders = [Loader(), Loader()]
    try:
        for version in (0, 1):
            weights = _tensors(version)
            manifest = sender.publish(version, weights)
            layout = layout_from_args(layout_args(manifest.layout))  # as it crosses vLLM's RPC
            address = GroupAddress(**address_args(manifest.handle))
            results = _run(
                [
                    functools.partial(_join_and_stream, m, address, layout, ld)
                    for m, ld in zip(members, loaders, strict=True)
                ]
            )
            sender.wait()
            assert all(isinstance(r, int) and r > 1 for r in results), results  # several loads per version
            for ld in loaders:
                for name, t in weights.items():
                    assert torch.equal(ld.params[name], t), name
    finally:
        sender.close()
    # Each load holds about a bucket of complete tensors (less than a bucket plus the largest tensor),
    # never the whole model.
    size = {n: t.numel() * t.element_size() for n, t in _tensors(0).items()}
    for batch in loaders[0].batches:
        assert sum(size[n] for n in batch) < BUCKET + max(size.values()) < sum(size.values())


def test_tensor_parallel_ranks_get_every_piece_from_rank_0() -> None:
    """TP rank 0 receives from the trainer and forwards each piece over the TP group (gloo here)."""
    from torch._C._distributed_c10d import TCPStore

    sender = make_sender("collective", "p", BUCKET, num_receivers=1, host="127.0.0.1", timeout_s=60.0)
    tp_store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    tp_address = GroupAddress("127.0.0.1", tp_store.port, 0, 2, "gloo")
    # vLLM's TP group exists before any sync: build both ranks' ends first.
    t = datetime.timedelta(seconds=20)
    stores = [tp_store, TCPStore("127.0.0.1", tp_store.port, None, False, t)]  # one client per rank
    groups = _run([functools.partial(build_group, stores[r], tp_address, r, t) for r in (0, 1)])
    assert not any(isinstance(g, BaseException) for g in groups), groups

    def tp_forward(rank: int) -> Callable[[torch.Tensor], None]:
        def forward(piece: torch.Tensor) -> None:
            broadcast(groups[rank], piece).wait()

        return forward

    member = GroupMember(datetime.timedelta(seconds=60))
    loaders = [Loader(), Loader()]
    weights = _tensors(3)
    try:
        manifest = sender.publish(0, weights)
        results = _run(
            [
                lambda: stream_version(
                    manifest.layout,
                    member.receiver(manifest.handle),
                    loaders[0],
                    torch.device("cpu"),
                    tp_forward(0),
                ),
                lambda: stream_version(manifest.layout, None, loaders[1], torch.device("cpu"), tp_forward(1)),
            ]
        )
        sender.wait()
    finally:
        sender.close()
    assert all(isinstance(r, int) for r in results), results
    for ld in loaders:
        assert all(torch.equal(ld.params[n], t) for n, t in weights.items())


def test_a_failure_before_any_load_leaves_the_model_untouched_and_after_one_says_so() -> None:
    layout = layout_for(_tensors(0), BUCKET, align=ALIGN)

    def broken_receive(piece: torch.Tensor) -> None:
        raise RuntimeError("connection reset")

    untouched = Loader()
    with pytest.raises(WeightSyncError) as first:
        stream_version(layout, broken_receive, untouched, torch.device("cpu"))
    assert not isinstance(first.value, WeightsWritten) and not untouched.batches
    assert all(not t.any() for t in untouched.params.values())

    source = _tensors(0)
    flat = torch.cat(
        [
            torch.nn.functional.pad(
                t.reshape(-1).view(torch.uint8), (0, -(t.numel() * t.element_size()) % ALIGN)
            )
            for t in source.values()
        ]
    )
    offset = [0]

    def local_receive(piece: torch.Tensor) -> None:  # the sender's bytes, in the layout's order
        piece.copy_(flat[offset[0] : offset[0] + piece.numel()])
        offset[0] += piece.numel()

    with pytest.raises(WeightsWritten, match="load failed"):
        stream_version(layout, local_receive, Loader(fail_at=1), torch.device("cpu"))


@pytest.mark.parametrize(
    "tamper",
    [
        lambda a: {**a, "digest": b"0" * 16},
        lambda a: {**a, "bucket_bytes": a["bucket_bytes"] // 2},
        lambda a: {**a, "specs": [(n, [*s[:-1], s[-1] + 1], d) for n, s, d in a["specs"]]},
        lambda a: {**a, "specs": [(n, s, "float128") for n, s, d in a["specs"]]},
    ],
    ids=["digest", "bucket size", "shape", "dtype"],
)
def test_a_layout_that_does_not_rebuild_exactly_is_refused(
    tamper: Callable[[dict[str, object]], dict[str, object]],
) -> None:
    layout = layout_for(_tensors(0), BUCKET, align=ALIGN)
    assert layout_from_args(layout_args(layout)) == layout
    with pytest.raises(WeightSyncError):
        layout_from_args(tamper(layout_args(layout)))


# -- the cudaipc path: what runs without CUDA (its data path: tests/runtime/gpu/test_vllm_worker_cudaipc.py)


class FakeModel:
    """The served model as the extension uses it: `load_weights` (which reports the names it loaded)
    and `named_parameters`."""

    def __init__(self, params: dict[str, torch.Tensor] | None = None) -> None:
        self.params = params or {}
        self.batches: list[list[str]] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        self.batches.append([name for name, _ in weights])
        for name, t in weights:
            self.params[name].copy_(t)
        return {name for name, _ in weights}

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.params.items())


class FakeWorker(PolyrlWorkerExtension):
    """vLLM's worker with the extension mixed in, as far as the cudaipc path reaches it."""

    def __init__(self, model: FakeModel) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)


def _plain(value: object) -> bool:
    """What vLLM's `collective_rpc` carries without insecure serialization."""
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, bool | int | float | str | bytes)


def _storage_args(nbytes: int) -> tuple[object, ...]:
    """`rebuild_cuda_tensor` arguments as the sender shares a storage (an unmappable handle)."""
    return (
        *(torch.Tensor, torch.Size([nbytes]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0),
        *(b"h" * 64, nbytes, 0, False, b"/polyrl-cudaipc-p.counts", 0, b"e" * 64, False),
    )


def test_a_cudaipc_handle_and_layout_cross_vllms_rpc_as_plain_values() -> None:
    handle = CudaIpcHandle(
        "GPU-5e1f", "1-b", "s", "/dev/shm/g", (_storage_args(96),), ((0, 0), (-1, 0), (0, 64))
    )
    args = handle_args(handle)
    assert _plain(args) and handle_from_args(args) == handle
    layout = layout_for(_tensors(0), BUCKET, LAYOUT_ALIGN)  # what the cudaipc sender plans
    assert _plain(layout_args(layout, LAYOUT_ALIGN))
    assert layout_from_args(layout_args(layout, LAYOUT_ALIGN)) == layout
    with pytest.raises(WeightSyncError, match="digest mismatch"):  # rebuilt with the collective's align
        layout_from_args(layout_args(layout))
    with pytest.raises(WeightSyncError, match="15"):
        handle_from_args({**args, "storages": [args["storages"][0][:-1]]})


def _receive_ipc(
    worker: FakeWorker, manifest: WeightManifest, layout: dict[str, object] | None = None
) -> dict[str, object]:
    return worker.polyrl_receive_ipc(
        manifest.policy,
        manifest.version,
        handle_args(manifest.handle),
        layout or layout_args(manifest.layout, LAYOUT_ALIGN),
        timeout_s=5.0,
    )


def test_the_worker_takes_a_cudaipc_version_while_the_trainer_serves_it() -> None:
    # A version without bytes runs the whole protocol without CUDA (and without vLLM: nothing of it
    # is imported on this path).
    sender = make_sender("cudaipc", "p", BUCKET)
    worker = FakeWorker(FakeModel())
    try:
        manifest = sender.publish(0, {})
        assert _receive_ipc(worker, manifest) == {"load_calls": 0, "tensors": 0, "written": False}
        sender.release_source()
        got = _receive_ipc(worker, manifest)
        assert not got["written"] and "version 0 is no longer served" in str(got["error"])
        assert _receive_ipc(worker, sender.publish(1, {}))["tensors"] == 0
    finally:
        sender.close()


def test_a_cudaipc_layout_that_does_not_fit_is_refused_before_anything_loads() -> None:
    sender = make_sender("cudaipc", "p", BUCKET)
    model = FakeModel({"w": torch.zeros(4)})
    worker = FakeWorker(model)
    other = layout_args(layout_for({"w": torch.zeros(4)}, BUCKET, LAYOUT_ALIGN), LAYOUT_ALIGN)
    try:
        manifest = sender.publish(0, {})
        refused = [
            _receive_ipc(worker, manifest, {**other, "digest": b"0" * 16}),  # does not rebuild
            _receive_ipc(worker, manifest, other),  # the handle places no tensor, the layout one
        ]
        assert "digest mismatch" in str(refused[0]["error"])
        assert "the cudaipc handle places 0 tensors, the layout has 1" in str(refused[1]["error"])
        assert all(not r["written"] for r in refused) and not model.batches
        # Off the trainer's GPU host: refused before any mapping, the guard never opened.
        foreign = CudaIpcHandle("GPU-5e1f", "elsewhere", "s", "/nonexistent", (_storage_args(16),), ((0, 0),))
        got = worker.polyrl_receive_ipc("p", 1, handle_args(foreign), other, timeout_s=5.0)
        assert "cudaipc needs the engine on the trainer's GPU host" in str(got["error"])
        assert not got["written"] and not model.batches and not model.params["w"].any()
    finally:
        sender.close()


def _mapped(tensors: dict[str, torch.Tensor], guard: ServeGuard, version: int = 0) -> MappedVersion:
    """A version in "the trainer's memory" on CPU: the tensors in one flat buffer, each at a multiple
    of 64 bytes (as a trainer's flat parameter buffer holds them: aligned for their dtype)."""
    layout = layout_for(tensors, BUCKET, LAYOUT_ALIGN)
    pieces = [
        torch.nn.functional.pad(byte_view(t), (0, -byte_view(t).numel() % 64)) for t in tensors.values()
    ]
    offsets = [sum(p.numel() for p in pieces[:i]) for i in range(len(pieces))]
    flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    guard.set_served(version)
    manifest = WeightManifest("p", version, "cudaipc", layout, None)
    return MappedVersion(manifest, [(flat, off) for off in offsets], guard)


def test_mapped_tensors_go_to_load_weights_as_views_about_a_bucket_at_a_time(tmp_path: Path) -> None:
    guard = ServeGuard.create(str(tmp_path), "p")
    weights = _tensors(5)
    mapped = _mapped(weights, guard)
    flat = mapped.sources[0]
    assert flat is not None
    held = {name: src[1] for name, src in zip(weights, mapped.sources, strict=True) if src is not None}
    seen: list[list[tuple[str, int]]] = []

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:  # where each tensor lies: no copy
        seen.append([(n, t.data_ptr() - flat[0].data_ptr()) for n, t in batch])
        for name, t in batch:
            assert torch.equal(t, weights[name]), name

    assert load_mapped(mapped, load, []) == len(seen) > 1
    assert [n for batch in seen for n, _ in batch] == list(weights)
    size = {n: t.numel() * t.element_size() for n, t in weights.items()}
    for batch in seen:
        assert sum(size[n] for n, _ in batch) < BUCKET + max(size.values())
    assert dict(pair for batch in seen for pair in batch) == held  # where the trainer holds them
    guard.destroy()


def test_a_mapped_version_failing_after_a_load_says_the_model_is_written(tmp_path: Path) -> None:
    guard = ServeGuard.create(str(tmp_path), "p")
    with pytest.raises(WeightsWritten, match="load failed"):
        load_mapped(_mapped(_tensors(0), guard), Loader(fail_at=1), [])
    with pytest.raises(WeightsWritten, match="load failed"):  # load_weights began: it may have written
        load_mapped(_mapped(_tensors(0), guard), Loader(fail_at=0), [])

    # The trainer stopped serving the version during the loads (it gave up on a stalled engine).
    def load_then_release(batch: list[tuple[str, torch.Tensor]]) -> None:
        guard.set_served(-1)

    with pytest.raises(WeightsWritten, match="stopped serving version 0 while this engine copied it"):
        load_mapped(_mapped(_tensors(0), guard), load_then_release, [])
    empty = _mapped({}, guard)
    guard.set_served(-1)
    with pytest.raises(WeightSyncError, match="stopped serving") as nothing_loaded:
        load_mapped(empty, load_then_release, [])
    assert not isinstance(nothing_loaded.value, WeightsWritten)
    guard.destroy()


def test_an_update_that_loads_nothing_of_the_model_is_refused_without_marking_it_written() -> None:
    load = ModelLoad(FakeModel({"w": torch.zeros(2), "v": torch.zeros(2)}))
    with pytest.raises(WeightSyncError, match="did not cover 2 served parameters") as info:
        load.check_covered()
    assert not isinstance(info.value, WeightsWritten)
    load([("w", torch.ones(2))])
    with pytest.raises(WeightsWritten, match=r"did not cover 1 served parameters, e.g. \['v'\]"):
        load.check_covered()
