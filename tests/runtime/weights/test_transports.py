"""Every transport: bit-exact round trips, all-or-nothing rejection, versions, late joiners."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from weights_harness import bit_equal, make_pair, random_tensors, sync, zeros_like_all

from polyrl_runtime.weights import SyncReport, VersionError, WeightMismatchError, WeightSyncError
from polyrl_runtime.weights.staging import ALIGN

ALL = ["objectstore", "shm", "collective"]

# Odd shapes, every dtype class the engines use; small buckets so tensors span and share buckets.
MIXED = {
    "emb": ((37, 13), torch.float32),
    "w.bf16": ((5, 7, 3), torch.bfloat16),
    "w.fp16": ((129,), torch.float16),
    "fp64": ((3, 3), torch.float64),
    "ids.i64": ((17,), torch.int64),
    "ids.i32": ((1, 9), torch.int32),
    "i8": ((31,), torch.int8),
    "u8": ((2, 2, 2), torch.uint8),
    "mask": ((11,), torch.bool),
    "scalar": ((), torch.float32),
    "empty": ((0, 4), torch.float32),
}


@pytest.fixture(params=ALL)
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "objectstore":
        request.getfixturevalue("ray_session")
    return str(request.param)


def _ok(results: list[Any]) -> list[SyncReport]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.parametrize("swappable", [False, True], ids=["in_place", "swap"])
@pytest.mark.parametrize("bucket_bytes", [7, 64, 1000, 1 << 20])
def test_round_trip_bit_exact(transport: str, bucket_bytes: int, swappable: bool) -> None:
    tensors = random_tensors(MIXED)
    sender, receivers = make_pair(transport, 2, bucket_bytes)
    targets = [zeros_like_all(tensors, swappable=swappable) for _ in receivers]
    try:
        reports = _ok(sync(sender, receivers, targets, 0, tensors))
    finally:
        sender.close()
    expected_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    for target, report in zip(targets, reports, strict=True):
        assert target.version == 0
        for name, t in tensors.items():
            assert bit_equal(target.named_tensors()[name], t), name
        assert report.applied and report.nbytes == expected_bytes
        assert report.control_messages == 1
        if transport == "objectstore":
            assert report.num_buckets == -(-expected_bytes // bucket_bytes)
        else:
            # Pipelined transports align each tensor's start (for the engine's swap) and cap chunks
            # below the bucket size: at least as many buckets, each at most one bucket.
            assert report.num_buckets >= -(-expected_bytes // max(bucket_bytes, ALIGN))


def test_zero_bytes(transport: str) -> None:
    tensors = {"empty": torch.empty(0, 3), "none": torch.empty(0, dtype=torch.bfloat16)}
    sender, receivers = make_pair(transport, 1, 1024)
    target = zeros_like_all(tensors)
    try:
        (report,) = _ok(sync(sender, receivers, [target], 3, tensors))
    finally:
        sender.close()
    assert report.nbytes == 0 and report.num_buckets == 0 and target.version == 3


def test_bf16_special_values_survive(transport: str) -> None:
    # NaN payloads, infinities and negative zero must arrive bit for bit, not merely "close".
    raw = torch.tensor([0x7FC1, 0xFF80, 0x7F80, 0x8000, 0x0001, 0x7FFF], dtype=torch.int32).to(torch.int16)
    tensors = {"x": raw.view(torch.bfloat16).clone()}
    sender, receivers = make_pair(transport, 1, 4)
    target = zeros_like_all(tensors)
    try:
        _ok(sync(sender, receivers, [target], 0, tensors))
    finally:
        sender.close()
    assert bit_equal(target.named_tensors()["x"], tensors["x"])


@pytest.mark.parametrize("swappable", [False, True], ids=["in_place", "swap"])
def test_versions_advance_and_repeat_is_noop(transport: str, swappable: bool) -> None:
    # Three versions: a swapping receiver alternates its two staging buffers (A, B, A again).
    sender, receivers = make_pair(transport, 1, 256)
    target = zeros_like_all(random_tensors(MIXED), swappable=swappable)
    try:
        for v in range(3):
            tensors = random_tensors(MIXED, seed=v)
            (report,) = _ok(sync(sender, receivers, [target], v, tensors))
            assert report.applied and target.version == v
            assert all(bit_equal(target.named_tensors()[k], t) for k, t in tensors.items())
        with pytest.raises(VersionError):
            sender.publish(2, tensors)
    finally:
        sender.close()


def _drop(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    del t["w.fp16"]  # the engine has a tensor the update lacks
    return t


def _extra(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**t, "extra": torch.ones(2)}  # the update has one the engine lacks


def _shape(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**t, "ids.i32": torch.zeros(9, 1, dtype=torch.int32)}


def _dtype(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**t, "i8": torch.zeros(31, dtype=torch.int16)}


@pytest.mark.parametrize(
    ("change", "offender"),
    [(_drop, "w.fp16"), (_extra, "extra"), (_shape, "ids.i32"), (_dtype, "i8")],
    ids=["missing", "extra", "shape", "dtype"],
)
@pytest.mark.parametrize("swappable", [False, True], ids=["in_place", "swap"])
def test_mismatch_rejected_and_old_version_kept(
    transport: str, change: Any, offender: str, swappable: bool
) -> None:
    v0 = random_tensors(MIXED, seed=1)
    sender, receivers = make_pair(transport, 2, 100)
    good, bad = zeros_like_all(v0, swappable=swappable), zeros_like_all(v0, swappable=swappable)
    try:
        _ok(sync(sender, receivers, [good, bad], 0, v0))
        v1 = change(random_tensors(MIXED, seed=2))
        # Only one engine is mismatched; build the sender's update for the other from its shape.
        results = sync(sender, receivers, [zeros_like_all(v1), bad], 1, v1)
    finally:
        sender.close()
    err = results[1]
    assert isinstance(err, WeightMismatchError), err
    assert err.name == offender and offender in str(err)
    assert bad.version == 0
    assert all(bit_equal(bad.named_tensors()[k], t) for k, t in v0.items())


def test_older_manifest_rejected(transport: str) -> None:
    tensors = random_tensors(MIXED)
    sender, receivers = make_pair(transport, 1, 512)
    target = zeros_like_all(tensors, version=5)
    try:
        (err,) = sync(sender, receivers, [target], 4, tensors)
    finally:
        sender.close()
    assert isinstance(err, VersionError)
    assert target.version == 5
    assert all(not v.any() for v in target.named_tensors().values())


def test_late_joiner_catches_up(transport: str) -> None:
    sender, receivers = make_pair(transport, 1, 300)
    first = zeros_like_all(random_tensors(MIXED))
    try:
        for v in range(3):
            _ok(sync(sender, receivers, [first], v, random_tensors(MIXED, seed=v)))
        latest = random_tensors(MIXED, seed=2)
        late_receiver = make_pair(transport, 1, 300)[1][0] if transport != "collective" else None
        late = zeros_like_all(latest)
        if transport == "collective":
            # Scale-out: a new group generation with both engines; the current one drains the resend.
            from polyrl_runtime.weights.collective import CollectiveReceiver, CollectiveSender

            assert isinstance(sender, CollectiveSender)
            sender.set_receivers(2)
            joiner = CollectiveReceiver(timeout_s=60.0)
            manifest = sender.resend()
            assert manifest is not None
            out: dict[str, Any] = {}
            t = threading.Thread(target=lambda: out.update(old=receivers[0].receive(manifest, first)))
            t.start()
            report = joiner.receive(manifest, late)
            t.join()
            sender.wait()
            assert out["old"].applied is False
        else:
            assert late_receiver is not None and sender.latest is not None
            report = late_receiver.receive(sender.latest, late)
    finally:
        sender.close()
    assert report.applied and late.version == 2
    assert all(bit_equal(late.named_tensors()[k], t) for k, t in latest.items())


@pytest.mark.parametrize("bucket_mib", [1, 4])
def test_round_trip_with_pieces_sent_from_the_tensors(transport: str, bucket_mib: int) -> None:
    """Tensors of a few MiB next to small ones: the collective sends pieces of at least DIRECT_MIN
    straight from the trainer's tensors and packs the rest, in the same broadcasts on both sides."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "a.small": torch.randn(7, 3, generator=g),
        "big": torch.randn(1000, 900, generator=g),  # 3.4 MiB: spans buckets, ends mid-bucket
        "b.small": torch.randn(33, generator=g).to(torch.bfloat16),
        "exact": torch.randn(256, 1024, generator=g),  # exactly 1 MiB
        "c.small": torch.arange(5, dtype=torch.int64),
        "tail": torch.randn(300, 1000, generator=g).to(torch.float16),
    }
    before = {k: v.clone() for k, v in tensors.items()}
    sender, receivers = make_pair(transport, 2, bucket_mib << 20)
    targets = [zeros_like_all(tensors) for _ in receivers]
    try:
        _ok(sync(sender, receivers, targets, 0, tensors))
    finally:
        sender.close()
    for target in targets:
        assert all(bit_equal(target.named_tensors()[k], t) for k, t in tensors.items())
    assert all(bit_equal(before[k], t) for k, t in tensors.items())  # the sender only reads them


def test_late_joiner_after_the_trainer_began_changing_its_weights(transport: str) -> None:
    """A collective sender keeps no copy of the version: once the trainer releases its tensors,
    `resend` declines (the next publish brings late joiners in). Stores keep serving the latest."""
    tensors = random_tensors(MIXED)
    sender, receivers = make_pair(transport, 1, 300)
    target = zeros_like_all(tensors)
    try:
        _ok(sync(sender, receivers, [target], 0, tensors))
        sender.release_source()
        resend = getattr(sender, "resend", None)
        if transport == "collective":
            assert resend is not None and resend() is None
        else:
            assert resend is None and sender.latest is not None and sender.latest.version == 0
        # The sender still works as before: the next version reaches everyone.
        _ok(sync(sender, receivers, [target], 1, random_tensors(MIXED, seed=1)))
    finally:
        sender.close()
    assert target.version == 1


def test_shm_stale_manifest_is_rejected() -> None:
    tensors = random_tensors(MIXED)
    sender, (receiver,) = make_pair("shm", 1, 512)
    target = zeros_like_all(tensors)
    try:
        old = sender.publish(0, tensors)
        sender.publish(1, random_tensors(MIXED, seed=9))
        with pytest.raises(WeightSyncError, match="holds version 1"):
            receiver.receive(old, target)
    finally:
        sender.close()
    assert target.version == -1 and all(not v.any() for v in target.named_tensors().values())


def test_collective_sender_failure_leaves_engine_intact() -> None:
    tensors = random_tensors(MIXED)
    sender, (receiver,) = make_pair("collective", 1, 512)
    target = zeros_like_all(tensors)
    try:
        _ok(sync(sender, [receiver], [target], 0, tensors))
        # A manifest for a group whose sender never shows up: the broadcast fails after the timeout.
        from dataclasses import replace

        from polyrl_runtime.weights.collective import CollectiveReceiver

        assert sender.latest is not None
        bogus = replace(sender.latest, version=1, handle=replace(sender.latest.handle, generation=99))
        quick = CollectiveReceiver(timeout_s=1.0)
        with pytest.raises(WeightSyncError):
            quick.receive(bogus, target)
    finally:
        sender.close()
    assert target.version == 0
    assert all(bit_equal(target.named_tensors()[k], t) for k, t in tensors.items())


def test_collective_abort_releases_an_engine_waiting_for_bytes() -> None:
    """An engine that waits for bytes no member will send (a dead one was to forward them) gives up
    when the sender aborts, long before the group's timeout; the next sync uses a new group."""
    tensors = random_tensors(MIXED)
    sender, (receiver,) = make_pair("collective", 1, 512)
    target = zeros_like_all(tensors)
    try:
        _ok(sync(sender, [receiver], [target], 0, tensors))
        assert sender.latest is not None
        abort = threading.Timer(0.5, sender.abort)  # type: ignore[attr-defined]
        abort.start()
        with pytest.raises(WeightSyncError, match="aborted"):
            receiver.receive(sender.latest, target)  # the sender sends nothing this time
        abort.join()
        _ok(sync(sender, [receiver], [target], 1, random_tensors(MIXED, seed=1)))
    finally:
        sender.close()
    assert target.version == 1
    assert all(bit_equal(target.named_tensors()[k], t) for k, t in random_tensors(MIXED, seed=1).items())


@pytest.mark.slow
def test_large_round_trip(transport: str) -> None:
    # Hundreds of MB: a few big fp32/bf16 matrices plus many small tensors, default-sized buckets.
    g = torch.Generator().manual_seed(0)
    tensors = {f"big{i}": torch.randn(4096, 8192, generator=g) for i in range(2)}  # 2 x 128 MiB
    tensors["bf16"] = torch.randn(4096, 4099, generator=g).to(torch.bfloat16)
    tensors.update({f"small{i}": torch.randn(i + 1, 3, generator=g) for i in range(200)})
    sender, receivers = make_pair(transport, 1, 64 << 20)
    target = zeros_like_all(tensors)
    try:
        (report,) = _ok(sync(sender, receivers, [target], 0, tensors))
    finally:
        sender.close()
    assert report.nbytes > 280 << 20
    assert all(bit_equal(target.named_tensors()[k], t) for k, t in tensors.items())


class _Work:
    """A gloo work whose waits run out of time `slices` times, then end with `error` (or succeed)."""

    def __init__(self, slices: int, error: str | None = None) -> None:
        self.slices, self.error, self.waits = slices, error, 0

    def wait(self, timeout: Any = None) -> bool:
        self.waits += 1
        if self.waits <= self.slices:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:  # the operation ended right after the slice ran out
        return True


def test_collective_wait_tells_a_slice_from_a_failure() -> None:
    from polyrl_runtime.weights.collective_group import wait_work

    done = _Work(slices=3)
    wait_work(done, lambda: False, "gloo")  # slices that ran out, even as the op completed, are not errors
    assert done.waits == 4
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_work(_Work(slices=1, error="Connection closed by peer"), lambda: False, "gloo")
    with pytest.raises(WeightSyncError, match="aborted"):
        wait_work(_Work(slices=10**9), lambda: True, "gloo")


def test_collective_members_wait_for_each_other_interruptibly() -> None:
    """Before a group is built, members wait for every rank to be taken; the wait ends when the last
    engine joins, when the sync is aborted, or at the timeout, with how many had joined."""
    import datetime

    from torch._C._distributed_c10d import TCPStore

    from polyrl_runtime.weights.collective_group import await_members

    store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    short = datetime.timedelta(seconds=0.2)
    await_members(store, 7, 0, lambda: False, short)  # no engines: nothing to wait for
    store.add("polyrl/weights/g7/rank", 1)
    with pytest.raises(WeightSyncError, match=r"1 of 2 engines joined group generation 7 within 0\.2 s"):
        await_members(store, 7, 2, lambda: False, short)
    with pytest.raises(WeightSyncError, match="aborted while engines joined group generation 7"):
        await_members(store, 7, 2, lambda: True, datetime.timedelta(seconds=60))
    joiner = threading.Timer(0.05, lambda: store.add("polyrl/weights/g7/rank", 1))
    joiner.start()
    await_members(store, 7, 2, lambda: False, datetime.timedelta(seconds=60))  # returns once it joins
    joiner.join()


def test_a_mismatch_names_policy_version_and_tensor_and_survives_pickling() -> None:
    import pickle

    from polyrl_runtime.weights.api import WeightMismatchError

    err = WeightMismatchError("model.w", "shape (3,) != engine's (4,)", "solver", 7)
    again = pickle.loads(pickle.dumps(err))  # as it crosses a Ray actor boundary
    assert (
        str(again)
        == str(err)
        == (
            "policy solver version 7: weight update rejected at tensor 'model.w': shape (3,) != engine's (4,)"
        )
    )
    assert (again.name, again.policy, again.version) == ("model.w", "solver", 7)
