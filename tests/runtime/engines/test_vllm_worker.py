"""The vLLM worker extension's receive path on CPU: the trainer's real collective sender (gloo), the
extension's group membership and bucket streaming, into a torch model's loader, without vLLM.

vLLM's part (its `load_weights`, its TP group) needs a GPU (test_vllm_engine.py); here a module's
`copy_` loader stands for `load_weights`, and a second gloo group for the TP group.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Callable

import pytest
import torch

from polyrl_runtime.engines.vllm_worker import (
    GroupMember,
    WeightsWritten,
    address_args,
    layout_args,
    layout_from_args,
    stream_version,
)
from polyrl_runtime.weights import make_sender
from polyrl_runtime.weights.api import WeightSyncError
from polyrl_runtime.weights.buckets import BucketLayout, layout_for
from polyrl_runtime.weights.collective import GroupAddress, broadcast, build_group
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
