"""Versions applied by swapping the engine's tensors, the `shm` slots engines serve from, and the
object-store objects `objectstore` engines serve from (small segments packed into one array per bucket).

The trainer never waits for an engine; an engine waits for a slot being packed at most `timeout_s`,
and in every failure keeps serving its old version, bit-exact.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from weights_harness import bit_equal, random_tensors, zeros_like_all

from polyrl_runtime.weights import SyncReport, TensorTarget, WeightSyncError, make_receiver, make_sender
from polyrl_runtime.weights import shm as shm_mod
from polyrl_runtime.weights.buckets import TensorSpec, plan_buckets, tensor_offsets
from polyrl_runtime.weights.objectstore import PACK_BELOW, object_plan, split_parts
from polyrl_runtime.weights.shm import ShmReceiver, ShmSender
from polyrl_runtime.weights.staging import ALIGN

MANY = {f"w{i}": ((1000 + i,), torch.float32) for i in range(12)} | {
    "bf": ((333,), torch.bfloat16),
    "mask": ((7,), torch.bool),
    "none": ((0,), torch.int64),
}


def test_aligned_layout_covers_every_byte_and_aligns_starts() -> None:
    specs = [TensorSpec(f"t{i}", (i * 3 + 1,), dt) for i, dt in enumerate([torch.bool, torch.float32] * 9)]
    specs.append(TensorSpec("empty", (0, 2), torch.float64))
    layout = plan_buckets(specs, 1000, align=ALIGN)
    assert all(b.nbytes <= 1000 - 1000 % ALIGN and b.offset % ALIGN == 0 for b in layout.buckets)
    offsets = tensor_offsets(layout)
    assert offsets[-1] == -1 and all(o % ALIGN == 0 for o in offsets[:-1])
    covered = [0] * len(specs)
    for b in layout.buckets:
        for seg in b.segments:
            assert b.offset <= seg.flat_offset and seg.flat_offset + seg.nbytes <= b.offset + b.nbytes
            assert seg.src_offset == covered[seg.tensor]
            covered[seg.tensor] += seg.nbytes
    assert covered == [s.nbytes for s in specs]
    assert layout.payload_bytes == sum(s.nbytes for s in specs)


def _serve(receiver: Any, manifest: Any, target: TensorTarget) -> SyncReport:
    report: SyncReport = receiver.receive(manifest, target)
    assert report.applied
    return report


def test_engine_serves_from_the_segment_and_a_busy_slot_sends_the_trainer_elsewhere() -> None:
    """An engine that missed a version still serves the older one from its slot: the trainer must not
    overwrite it (it moves to a new segment and never waits), and the engine stays bit-exact."""
    versions = [random_tensors(MANY, seed=s) for s in range(4)]
    sender = ShmSender("p", 1 << 20)
    engine, other = ShmReceiver(timeout_s=5), ShmReceiver(timeout_s=5)
    behind = zeros_like_all(versions[0], swappable=True)
    current = zeros_like_all(versions[0], swappable=True)
    try:
        m0 = sender.publish(0, versions[0])
        _serve(engine, m0, behind)
        _serve(other, m0, current)
        m1 = sender.publish(1, versions[1])  # the other slot of the same segment
        assert m1.handle.path == m0.handle.path and m1.handle.slot != m0.handle.slot
        _serve(other, m1, current)  # `behind` misses version 1 and keeps serving 0 from slot 0
        start = time.monotonic()
        m2 = sender.publish(2, versions[2])
        assert time.monotonic() - start < 5
        assert m2.handle.path != m0.handle.path  # slot 0 was busy: a new segment
        assert all(bit_equal(behind.named_tensors()[k], x) for k, x in versions[0].items())
        _serve(engine, m2, behind)
        _serve(other, m2, current)
        # Both moved on: the next version reuses the new segment's other slot.
        m3 = sender.publish(3, versions[3])
        assert m3.handle.path == m2.handle.path and m3.handle.slot != m2.handle.slot
        _serve(engine, m3, behind)
    finally:
        sender.close()
    assert behind.version == 3 and current.version == 2
    assert all(bit_equal(behind.named_tensors()[k], x) for k, x in versions[3].items())
    assert all(bit_equal(current.named_tensors()[k], x) for k, x in versions[2].items())


def test_slot_still_being_written_times_out_and_old_version_kept() -> None:
    v0, v1 = random_tensors(MANY, seed=0), random_tensors(MANY, seed=1)
    sender, receiver = ShmSender("p", 1 << 20), ShmReceiver(timeout_s=0.3)
    target = zeros_like_all(v0, swappable=True)
    try:
        _serve(receiver, sender.publish(0, v0), target)
        m1 = sender.publish(1, v1)
        # A trainer stuck while packing holds the slot exclusive: the engine gives up, bounded.
        assert sender._seg is not None and sender._seg.try_lock(m1.handle.slot, exclusive=True)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="still being written"):
            receiver.receive(m1, target)
        assert time.monotonic() - start < 5
        sender._seg.unlock(m1.handle.slot)
        # A trainer that died mid-pack leaves the slot marked as being written: rejected at once.
        sender._seg.words[shm_mod._SLOT_VERSION + m1.handle.slot] = shm_mod._WRITING
        with pytest.raises(WeightSyncError, match="keeps its current weights"):
            receiver.receive(m1, target)
    finally:
        sender.close()
    assert target.version == 0
    assert all(bit_equal(target.named_tensors()[k], t) for k, t in v0.items())


_CHILD = """
import sys, time, torch
from polyrl_runtime.weights import TensorTarget
from polyrl_runtime.weights.shm import ShmHandle, ShmReceiver
from polyrl_runtime.weights.api import WeightManifest
import pickle
manifest = pickle.loads(bytes.fromhex(sys.argv[1]))
target = TensorTarget({s.name: torch.zeros(s.shape, dtype=s.dtype) for s in manifest.layout.specs}, swappable=True)
ShmReceiver().receive(manifest, target)
print("serving", flush=True)
time.sleep(600)
"""


def test_a_dead_engine_does_not_hold_the_trainer() -> None:
    """An engine process killed while serving from a slot: the kernel drops its lock, and the
    trainer reuses the slot (same segment) instead of working around it."""
    import os
    import pickle
    import subprocess
    import sys

    v = [random_tensors(MANY, seed=s) for s in range(3)]
    sender = ShmSender("p", 1 << 20)
    try:
        m0 = sender.publish(0, v[0])
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, pickle.dumps(m0).hex()],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == b"serving"
            sender.publish(1, v[1])
            child.kill()
            child.wait(10)
            m2 = sender.publish(2, v[2])
            assert m2.handle.path == m0.handle.path and m2.handle.slot == m0.handle.slot
        finally:
            child.kill()
    finally:
        sender.close()


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, one name
        self.norm = torch.nn.LayerNorm(6)
        self.register_buffer("scale", torch.arange(6, dtype=torch.float64))
        self.inner = torch.nn.Module()
        self.inner.register_buffer("steps", torch.tensor(3, dtype=torch.int64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.emb(ids)) * self.scale.float())
        return out


@pytest.mark.parametrize("transport", ["shm", "collective", "objectstore"])
def test_module_target_swaps_parameters_and_keeps_its_buffers(
    transport: str, request: pytest.FixtureRequest
) -> None:
    if transport == "objectstore":
        request.getfixturevalue("ray_session")
    torch.manual_seed(0)
    trainer, engine = _Tied(), _Tied()
    for p in engine.parameters():
        p.requires_grad_(False)
    target = TensorTarget.from_module(engine)
    assert target.swappable
    kwargs: dict[str, Any] = {"num_receivers": 1, "host": "127.0.0.1"} if transport == "collective" else {}
    sender = make_sender(transport, "p", 64, **kwargs)
    receiver = make_receiver(transport)
    ids = torch.tensor([[1, 2, 3]])
    params_before = {k: id(p) for k, p in engine.named_parameters()}
    try:
        for v in range(3):  # A, B, A: the staging buffer that served version v-2 is reused
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.5)
            state = {k: p.detach() for k, p in trainer.named_parameters()}  # tied head.weight once
            named = dict(target.named_tensors())
            assert set(named) == set(state)  # parameters only: buffers are not published
            manifest = sender.publish(v, {k: state[k] for k in named})
            out: dict[str, Any] = {}
            t = threading.Thread(target=lambda m=manifest, o=out: o.update(r=receiver.receive(m, target)))
            t.start()
            t.join(60)
            sender.wait()
            assert out["r"].applied and target.version == v
            for k, x in engine.state_dict().items():
                assert bit_equal(x, trainer.state_dict()[k]), k
            assert engine.head.weight is engine.emb.weight  # tying survives: same Parameter object
            assert {k: id(p) for k, p in engine.named_parameters()} == params_before
            assert torch.equal(engine(ids), trainer(ids))
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("transport", ["shm", "collective", "objectstore"])
def test_a_receiver_never_writes_buffers_another_target_serves_from(
    transport: str, request: pytest.FixtureRequest
) -> None:
    if transport == "objectstore":
        request.getfixturevalue("ray_session")
    # One receiver, targets taking turns: each swapped target keeps the bytes of its version.
    kwargs: dict[str, Any] = {"num_receivers": 1, "host": "127.0.0.1"} if transport == "collective" else {}
    sender = make_sender(transport, "p", 256, **kwargs)
    receiver = make_receiver(transport)
    versions = [random_tensors(MANY, seed=s) for s in range(4)]
    targets = [zeros_like_all(versions[0], swappable=True) for _ in range(4)]
    try:
        for v, target in enumerate(targets):
            manifest = sender.publish(v, versions[v])
            out: dict[str, Any] = {}
            t = threading.Thread(
                target=lambda m=manifest, x=target, o=out: o.update(r=receiver.receive(m, x))
            )
            t.start()
            t.join(60)
            sender.wait()
            assert out["r"].applied
    finally:
        sender.close()
        receiver.close()
    for v, target in enumerate(targets):
        assert all(bit_equal(target.named_tensors()[k], x) for k, x in versions[v].items()), v


def test_objectstore_engines_serve_from_the_fetched_object(ray_session: Any) -> None:
    """Whole tensors become views of the object (engines on one node share its memory, nothing is
    copied); a tensor split across buckets is assembled privately; every byte is exact either way."""
    versions = [random_tensors(MANY, seed=s) for s in range(2)]
    nbytes = {k: t.numel() * t.element_size() for k, t in versions[0].items()}
    for bucket_bytes, shared in ((1 << 20, True), (999, False)):
        sender, receivers = make_sender("objectstore", "p", bucket_bytes), [make_receiver("objectstore")] * 2
        targets = [zeros_like_all(versions[0], swappable=True) for _ in receivers]
        try:
            for v, tensors in enumerate(versions):
                manifest = sender.publish(v, tensors)
                reports = [r.receive(manifest, t) for r, t in zip(receivers, targets, strict=True)]
                assert all(r.applied for r in reports)
                for target in targets:
                    assert all(bit_equal(target.named_tensors()[k], x) for k, x in tensors.items())
                a, b = (t.named_tensors() for t in targets)
                same = {k for k in a if nbytes[k] and a[k].data_ptr() == b[k].data_ptr()}
                # 1 MiB buckets: one object holds every tensor whole. 999 bytes: each w* (4000+ bytes)
                # spans buckets, so only the small ones can be views.
                assert same == ({k for k in a if nbytes[k]} if shared else {"bf", "mask"}), same
        finally:
            sender.close()


# Tensors on both sides of objectstore's packing threshold, a large one split across buckets, and
# small ones of odd sizes between them (so packed offsets need alignment for a typed view).
MIXED_SIZES = {
    "big": ((PACK_BELOW // 4 + 3,), torch.float32),
    "odd": ((5,), torch.bool),
    "bf": ((333,), torch.bfloat16),
    "huge": ((PACK_BELOW,), torch.bfloat16),  # 2 * PACK_BELOW bytes: spans the 1.5x buckets below
    "f64": ((7,), torch.float64),
    "none": ((0,), torch.int64),
}


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "in_place"])
def test_objectstore_packs_small_segments_and_sends_large_ones_as_they_are(
    ray_session: Any, swap: bool
) -> None:
    """Below `PACK_BELOW` a bucket's segments share one packed array, above it each is its own array;
    either way every byte arrives exact, and a swapping engine serves whole tensors as views of the
    fetched objects, shared by the engines of one node."""
    bucket_bytes = PACK_BELOW * 3 // 2
    versions = [random_tensors(MIXED_SIZES, seed=s) for s in range(2)]
    sender, receivers = make_sender("objectstore", "p", bucket_bytes), [make_receiver("objectstore")] * 2
    targets = [zeros_like_all(versions[0], swappable=swap) for _ in receivers]
    try:
        for v in range(3):
            tensors = versions[min(v, 1)]
            if v == 2:  # written in place: the sender's cached views and copy plans must see the new bytes
                for k, t in random_tensors(MIXED_SIZES, seed=7).items():
                    tensors[k].copy_(t)
            manifest = sender.publish(v, tensors)
            plan = object_plan(manifest.layout)
            where = {
                s.name: {p.array > 0 for p in plan.by_tensor[i]} for i, s in enumerate(manifest.layout.specs)
            }
            assert where["big"] == {True}  # sent as it is
            assert where["odd"] == where["bf"] == where["f64"] == {False}  # packed
            assert len(plan.by_tensor[[s.name for s in manifest.layout.specs].index("huge")]) >= 2
            assert True in where["huge"]  # its pieces of PACK_BELOW or more are sent as they are
            assert all(r.receive(manifest, t).applied for r, t in zip(receivers, targets, strict=True))
            for target in targets:
                assert all(bit_equal(target.named_tensors()[k], x) for k, x in tensors.items()), v
            if swap:
                a, b = (t.named_tensors() for t in targets)
                shared = {k for k in a if a[k].numel() and a[k].data_ptr() == b[k].data_ptr()}
                assert shared == {"big", "odd", "bf", "f64"}  # "huge" is assembled: it spans buckets
    finally:
        sender.close()


def _arrays(*kib: int) -> list[Any]:
    return [np.zeros(k << 10, np.uint8) for k in kib]


@pytest.mark.parametrize(
    ("kib", "parts", "expected"),
    [
        ([512] * 16, 2, [8, 8]),  # 8 MiB in mid-sized arrays: two runs of equal bytes
        ([512] * 16, 1, [16]),  # one thread: one run
        ([64] * 16, 2, [16]),  # 1 MiB in all: too small to be worth a second put
        ([6 << 10] * 2, 2, [2]),  # few large arrays: Ray copies each on several threads already
        ([3072, 512, 512, 512, 512], 2, [1, 4]),  # a run holds its share before the next starts
        ([512] * 12, 4, [3, 3, 3, 3]),
    ],
)
def test_split_parts(kib: list[int], parts: int, expected: list[int]) -> None:
    arrays = _arrays(*kib)
    runs = split_parts(arrays, parts)
    assert [len(r) for r in runs] == expected
    assert [a for r in runs for a in r] == arrays  # in order, nothing lost


def test_objectstore_puts_a_bucket_of_many_mid_sized_tensors_in_parts(
    ray_session: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POLYRL_COPY_THREADS", "2")
    spec = {f"w{i}": ((PACK_BELOW,), torch.float32) for i in range(24)} | {"b": ((3,), torch.bfloat16)}
    tensors = random_tensors(spec, seed=3)
    sender, receiver = make_sender("objectstore", "p", 64 << 20), make_receiver("objectstore")
    target = zeros_like_all(tensors, swappable=True)
    try:
        manifest = sender.publish(0, tensors)
        assert len(manifest.handle) == 1 and len(manifest.handle[0]) == 2  # one bucket, two objects
        assert receiver.receive(manifest, target).applied
        assert all(bit_equal(target.named_tensors()[k], x) for k, x in tensors.items())
    finally:
        sender.close()
