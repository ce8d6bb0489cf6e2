"""Pipelined `shm` (per-chunk flags, no per-chunk messages) and swap-applied versions.

The writer never waits for a reader; a reader waits for the writer at most `timeout_s` without
progress, detects being overtaken (seqlock), and in every failure keeps serving its old version.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from weights_harness import bit_equal, random_tensors, zeros_like_all

from polyrl_runtime.weights import TensorTarget, WeightSyncError, make_receiver, make_sender
from polyrl_runtime.weights import shm as shm_mod
from polyrl_runtime.weights.buckets import TensorSpec, plan_buckets, tensor_offsets
from polyrl_runtime.weights.shm import ShmReceiver, ShmSender
from polyrl_runtime.weights.staging import ALIGN

MANY = {f"w{i}": ((1000 + i,), torch.float32) for i in range(12)} | {
    "bf": ((333,), torch.bfloat16),
    "mask": ((7,), torch.bool),
    "none": ((0,), torch.int64),
}


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of 1 KiB: a ~50 KB version is ~50 chunks, each a flag the reader must follow.
    monkeypatch.setattr(shm_mod, "CHUNK", 1024)


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


def test_reader_follows_the_writer_chunk_by_chunk(
    small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow writer: the reader starts long before packing ends and applies exactly the new version."""
    tensors = random_tensors(MANY)
    sender, receiver = ShmSender("p", 1 << 20), ShmReceiver(timeout_s=30)
    target = zeros_like_all(tensors, swappable=True)
    real = shm_mod.copy_pairs

    def slow(pairs: Any, threads: int | None = None) -> None:
        if threading.current_thread().name.startswith("polyrl-shm"):
            time.sleep(0.005)
        real(pairs, threads)

    monkeypatch.setattr(shm_mod, "copy_pairs", slow)
    try:
        manifest = sender.publish(0, tensors)
        assert len(manifest.layout.buckets) > 40
        report = receiver.receive(manifest, target)
        sender.wait()
    finally:
        sender.close()
    assert report.applied and report.control_messages == 1 and target.version == 0
    assert all(bit_equal(target.named_tensors()[k], t) for k, t in tensors.items())


def test_writer_that_stalls_mid_sync_times_out_and_old_version_kept(
    small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    v0, v1 = random_tensors(MANY, seed=0), random_tensors(MANY, seed=1)
    sender, receiver = ShmSender("p", 1 << 20), ShmReceiver(timeout_s=0.5)
    target = zeros_like_all(v0, swappable=True)
    try:
        receiver.receive(sender.publish(0, v0), target)
        stalled = threading.Event()

        def dies_halfway(seg: Any, version: int, per_bucket: list[Any]) -> None:
            for i, pairs in enumerate(per_bucket[: len(per_bucket) // 2]):
                shm_mod.copy_pairs(pairs)
                seg.flags[i] = version
            stalled.set()  # then nothing, as if the trainer process had died

        monkeypatch.setattr(sender, "_pack", dies_halfway)
        manifest = sender.publish(1, v1)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="did not arrive within"):
            receiver.receive(manifest, target)
        assert time.monotonic() - start < 10 and stalled.is_set()
    finally:
        sender.close()
    assert target.version == 0
    assert all(bit_equal(target.named_tensors()[k], t) for k, t in v0.items())


def test_writer_failure_is_reported_to_reader_and_sender(
    small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    v0 = random_tensors(MANY, seed=0)
    sender, receiver = ShmSender("p", 1 << 20), ShmReceiver(timeout_s=30)
    target = zeros_like_all(v0)
    real = shm_mod.copy_pairs
    calls = [0]

    def fails_later(pairs: Any, threads: int | None = None) -> None:
        if threading.current_thread().name.startswith("polyrl-shm"):
            calls[0] += 1
            if calls[0] == 5:
                raise OSError("disk on fire")
        real(pairs, threads)

    monkeypatch.setattr(shm_mod, "copy_pairs", fails_later)
    try:
        manifest = sender.publish(0, v0)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="failed while packing"):
            receiver.receive(manifest, target)
        assert time.monotonic() - start < 10  # fails fast, not after timeout_s
        with pytest.raises(WeightSyncError, match="disk on fire"):
            sender.wait()
    finally:
        sender.close()
    assert target.version == -1 and all(not t.any() for t in target.named_tensors().values())


def test_stalled_reader_never_blocks_the_writer_and_rejects_the_overwritten_version(
    small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader stuck mid-sync (or dead) holds nothing the writer waits for; when it resumes after
    newer versions overwrote its chunks, its copy is detected as torn and it keeps its old weights."""
    versions = [random_tensors(MANY, seed=s) for s in range(4)]
    sender = ShmSender("p", 1 << 20)
    stuck, fresh = ShmReceiver(timeout_s=30), ShmReceiver(timeout_s=30)
    stuck_target = zeros_like_all(versions[0], swappable=True)
    fresh_target = zeros_like_all(versions[0])
    real = shm_mod.copy_pairs
    release, inside = threading.Event(), threading.Event()
    seen = [0]

    def blocks_stuck_reader(pairs: Any, threads: int | None = None) -> None:
        if threading.current_thread().name == "stuck":
            seen[0] += 1
            if seen[0] == 3:  # mid-sync: two chunks copied, the third one being copied
                real(pairs, threads)
                inside.set()
                release.wait(30)
                return
        real(pairs, threads)

    monkeypatch.setattr(shm_mod, "copy_pairs", blocks_stuck_reader)
    out: dict[str, Any] = {}

    def run_stuck(manifest: Any) -> None:
        try:
            out["report"] = stuck.receive(manifest, stuck_target)
        except BaseException as e:
            out["error"] = e

    try:
        stuck.receive(sender.publish(0, versions[0]), stuck_target)
        m1 = sender.publish(1, versions[1])
        sender.wait()
        t = threading.Thread(target=run_stuck, args=(m1,), name="stuck")
        t.start()
        assert inside.wait(10)
        start = time.monotonic()
        for v in (2, 3):  # the writer goes on regardless of the stuck reader
            manifest = sender.publish(v, versions[v])
            sender.wait()
        assert time.monotonic() - start < 10
        assert fresh.receive(manifest, fresh_target).applied
        release.set()
        t.join(10)
    finally:
        release.set()
        sender.close()
    assert isinstance(out.get("error"), WeightSyncError), out
    assert "holds version 3" in str(out["error"])
    assert stuck_target.version == 0
    assert all(bit_equal(stuck_target.named_tensors()[k], x) for k, x in versions[0].items())
    assert all(bit_equal(fresh_target.named_tensors()[k], x) for k, x in versions[3].items())


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


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_module_target_swaps_parameters_and_buffers(transport: str) -> None:
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
                trainer.get_buffer("scale").mul_(2.0)
                trainer.get_buffer("inner.steps").add_(1)
            state = {k: t.detach() for k, t in trainer.state_dict().items() if k != "head.weight"}
            named = dict(target.named_tensors())
            assert set(named) == set(state)
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


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_a_receiver_never_writes_buffers_another_target_serves_from(transport: str) -> None:
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
