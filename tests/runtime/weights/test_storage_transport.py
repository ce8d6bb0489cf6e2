"""The `storage` transport (weightSync.transport storage): versions written under a URI, whole every
`full_every` versions and as bit-exact deltas in between, on a file system and on a real S3 server.
An engine one version behind fetches one delta, a joining one the newest whole version and the deltas
since; a failed check takes the long way, and a version that cannot be applied is named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from polyrl_runtime import storage
from polyrl_runtime.weights import TensorTarget, WeightSyncError, make_receiver, make_sender
from polyrl_runtime.weights.registry import sender_options
from polyrl_runtime.weights.storage import policy_root

from .weights_harness import DELTA_SHAPES, bf16_weights, next_version


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a
    )


def engine(swap: bool = True) -> TensorTarget:
    """A fresh engine: the right shapes, none of the trainer's values, no version."""
    return TensorTarget(
        {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in DELTA_SHAPES.items()}, -1, swappable=swap
    )


@pytest.fixture(params=["file", "s3"])
def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/weights"
    bucket = request.getfixturevalue("bucket")
    return f"s3://{bucket}/job/weights"


def sender(uri: str, full_every: int) -> Any:
    return make_sender(
        "storage", "alice", 1 << 20, **sender_options("storage", receivers=1, uri=uri, full_every=full_every)
    )


@pytest.mark.parametrize("swap", [True, False], ids=["swapping", "in-place"])
def test_engines_behind_fetch_deltas_and_a_joiner_the_whole_version_and_deltas_since(
    uri: str, swap: bool
) -> None:
    out = sender(uri, full_every=3)
    receiver = make_receiver("storage")
    follower = engine(swap)  # receives every version
    versions = [bf16_weights(0)]
    report = receiver.receive(out.publish(0, versions[0]), follower)
    assert equal(dict(follower.named_tensors()), versions[0]) and report.applied
    whole_bytes = report.nbytes
    for v in range(1, 6):
        versions.append(next_version(versions[-1], v))
        manifest = out.publish(v, versions[-1])
        report = receiver.receive(manifest, follower)
        assert follower.version == v and equal(dict(follower.named_tensors()), versions[-1])
        if v % 3:  # a delta from the version before: a fraction of the whole
            assert len(manifest.deltas) == v % 3 and 0 < report.nbytes < whole_bytes / 2, report
        else:  # every third version is written whole
            assert manifest.deltas == () and report.nbytes == whole_bytes
        # An engine that joins now catches up from the newest whole version and the deltas since.
        joiner = engine(swap)
        joined = receiver.receive(manifest, joiner)
        assert equal(dict(joiner.named_tensors()), versions[-1]) and joiner.version == v
        assert joined.nbytes == whole_bytes + sum(link.nbytes for link in manifest.deltas)
    # Under the prefix: the newest whole version (3) with its deltas (4, 5), and the whole version
    # before it (0) with its deltas (1, 2), which an engine might still be reading. The next whole
    # version (6) removes the older generation.
    root = policy_root(uri, "alice")
    assert len(storage.list_names(root)) == 6
    out.publish(6, next_version(versions[-1], 6))
    assert [n.split(".")[0] for n in storage.list_names(root)] == [f"v{v:012d}" for v in (3, 4, 5, 6)]


def test_a_failed_check_takes_the_long_way_and_a_damaged_version_is_named(uri: str) -> None:
    out = sender(uri, full_every=8)
    receiver = make_receiver("storage")
    v0 = bf16_weights(0)
    target = engine()
    receiver.receive(out.publish(0, v0), target)
    # The engine's tensors are no longer what version 0 was (damaged in memory): the delta's checksum
    # fails on "proj", and the whole version and the deltas since bring it to version 1 all the same.
    target.named_tensors()["proj"][0, 0] += 1
    v1 = next_version(v0, 1)
    with capture_logs() as logs:
        receiver.receive(out.publish(1, v1), target)
    assert equal(dict(target.named_tensors()), v1)
    (rejected,) = [e for e in logs if e["event"] == "weights.delta_rejected"]
    assert rejected["tensor"] == "proj" and rejected["version"] == 1 and rejected["base"] == 0
    # A damaged whole version fails the update, naming the policy, the version and the tensor: the
    # engine keeps the version it holds.
    manifest = out.publish(2, next_version(v1, 2))
    data = bytearray(storage.read_bytes(manifest.handle.handle))
    data[-40] ^= 0xFF  # inside the last tensor's values
    storage.write_bytes(manifest.handle.handle, bytes(data))
    joiner = engine()
    with pytest.raises(WeightSyncError, match=r"policy alice version 2: tensor '\w+'.*keeps version -1"):
        receiver.receive(manifest, joiner)
    assert joiner.version == -1 and all(not t.any() for t in joiner.named_tensors().values())


def test_a_new_trainer_clears_what_an_earlier_one_left(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/weights"
    first = sender(uri, full_every=2)
    v = bf16_weights(0)
    for version in range(5):
        first.publish(version, v)
    root = policy_root(uri, "alice")
    assert len(storage.list_names(root)) == 3  # whole 2 with delta 3, whole 4
    # A restarted trainer publishes past the versions its engines served; its first version is whole.
    second = sender(uri, full_every=2)
    manifest = second.publish(7, v)
    assert storage.list_names(root) == ["v000000000007.whole"] and manifest.deltas == ()


def test_storage_needs_a_uri_and_writes_nothing_until_it_publishes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="writes versions under a uri"):
        sender_options("storage", receivers=1)
    sender(f"file://{tmp_path}/w", full_every=1)
    assert not (tmp_path / "w").exists()
