"""collective with deltas (weightSync.deltas over collective): each version after the first broadcast
as the bit-exact deltas from the one before; an engine that cannot apply them keeps its version and
gets the whole one from the sender's host copy, which also serves late joiners at any time."""

from __future__ import annotations

import threading

import torch

from polyrl_runtime.weights import TensorTarget
from polyrl_runtime.weights.api import DeltaRejectedError, SyncReport
from polyrl_runtime.weights.collective import CollectiveReceiver, CollectiveSender

from .weights_harness import bf16_weights, next_version, sync

SHAPES = {"embed": (256, 64), "proj": (64, 64), "norm": (64,), "bias": (3,)}


def equal(target: TensorTarget, expected: dict[str, torch.Tensor]) -> bool:
    own = target.named_tensors()
    return all(torch.equal(own[n].view(torch.int16), t.view(torch.int16)) for n, t in expected.items())


def engine() -> TensorTarget:
    return TensorTarget(
        {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}, -1, swappable=True
    )


def pair(receivers: int) -> tuple[CollectiveSender, list[CollectiveReceiver]]:
    sender = CollectiveSender(
        "alice", 1 << 20, num_receivers=receivers, host="127.0.0.1", timeout_s=60.0, deltas=1
    )
    return sender, [CollectiveReceiver(timeout_s=60.0) for _ in range(receivers)]


def reports(results: list[SyncReport | BaseException]) -> list[SyncReport]:
    out = [r for r in results if isinstance(r, SyncReport)]
    assert len(out) == len(results), results
    return out


def test_versions_after_the_first_are_broadcast_as_deltas_bit_exact() -> None:
    sender, receivers = pair(2)
    targets = [engine(), engine()]
    versions = [bf16_weights(0, SHAPES)]
    first = reports(sync(sender, receivers, targets, 0, versions[0]))
    whole = first[0].nbytes
    assert (
        sender.latest is not None
        and sender.latest.deltas == ()
        and all(equal(t, versions[0]) for t in targets)
    )
    for v in range(1, 4):
        versions.append(next_version(versions[-1], v, fraction=0.02))
        got = reports(sync(sender, receivers, targets, v, versions[-1]))
        manifest = sender.latest
        assert manifest is not None and len(manifest.deltas) == 1
        link = manifest.deltas[0]
        assert (link.base, link.version) == (v - 1, v)
        assert all(r.applied and 0 < r.nbytes == link.nbytes < whole / 4 for r in got), got
        assert all(t.version == v and equal(t, versions[-1]) for t in targets)
    sender.close()


def test_an_engine_that_cannot_apply_them_keeps_its_version_and_gets_the_whole_one() -> None:
    sender, receivers = pair(2)
    good, damaged = engine(), engine()
    v0 = bf16_weights(0, SHAPES)
    reports(sync(sender, receivers, [good, damaged], 0, v0))
    damaged.named_tensors()["proj"][0, 0] += 1  # no longer version 0: the delta's check fails
    v1 = next_version(v0, 1, fraction=0.02)
    sender.release_source()  # the trainer's step changes its tensors
    ok, rejected = sync(sender, receivers, [good, damaged], 1, v1)
    assert isinstance(ok, SyncReport) and ok.applied and equal(good, v1)
    assert isinstance(rejected, DeltaRejectedError), rejected
    assert "tensor 'proj'" in str(rejected) and "needs the whole version" in str(rejected)
    assert damaged.version == 0  # it kept what it held
    # The whole version, from the sender's host copy (the trainer's tensors are released): the
    # engine that has it drains the broadcast without applying it, the other applies it.
    resent = sender.resend()
    assert resent is not None and resent.version == 1 and resent.deltas == ()

    got: dict[int, SyncReport] = {}

    def receive(i: int, target: TensorTarget) -> None:
        got[i] = receivers[i].receive(resent, target)

    threads = [threading.Thread(target=receive, args=(i, t)) for i, t in enumerate((good, damaged))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sender.wait()
    assert [got[0].applied, got[1].applied] == [False, True]
    assert damaged.version == 1 and equal(damaged, v1)
    sender.close()


def test_an_engine_at_another_version_is_told_it_needs_the_whole_one() -> None:
    sender, (receiver,) = pair(1)
    target = engine()
    v0 = bf16_weights(0, SHAPES)
    reports(sync(sender, [receiver], [target], 0, v0))
    stale = TensorTarget({n: t.clone() for n, t in target.named_tensors().items()}, -1, swappable=True)
    (result,) = sync(sender, [receiver], [stale], 1, next_version(v0, 1, fraction=0.02))
    assert isinstance(result, DeltaRejectedError)
    assert "sent as deltas from version 0, the engine holds -1" in str(result)
    sender.close()
