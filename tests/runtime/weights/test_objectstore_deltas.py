"""objectstore with deltas (weightSync.deltas): each version also as the bit-exact deltas from the one
before, an engine at one of the chain's versions catching up through them, checked tensor by tensor,
and the whole version whenever a check fails."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from polyrl_runtime.weights import TensorTarget, make_receiver, make_sender
from polyrl_runtime.weights.api import DeltaLink, WeightManifest
from polyrl_runtime.weights.delta import DeltaError, make_delta
from polyrl_runtime.weights.delta_chain import DeltaChain, apply_chain, chain_from, decode_link
from polyrl_runtime.weights.registry import sender_options

from .weights_harness import bf16_weights, next_version


def target(tensors: dict[str, torch.Tensor], version: int, swap: bool) -> TensorTarget:
    own = {n: t.clone() for n, t in tensors.items()}
    return TensorTarget(own, version, swappable=swap)


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a
    )


def test_a_chain_leads_from_any_version_it_covers_and_only_from_those() -> None:
    links = tuple(DeltaLink(v, v + 1, 10, None) for v in (3, 4, 5))
    m = WeightManifest("p", 6, "objectstore", layout=None, deltas=links)  # type: ignore[arg-type]
    assert [link.base for link in chain_from(m, 4)] == [4, 5]
    assert chain_from(m, 6) == [] and chain_from(m, 2) == [] and chain_from(m, -1) == []
    broken = WeightManifest("p", 6, "objectstore", layout=None, deltas=(links[0], links[2]))  # type: ignore[arg-type]
    assert chain_from(broken, 3) == []


def test_a_chain_applied_is_bit_exact_and_keeps_what_did_not_change() -> None:
    chain = DeltaChain(keep=2)
    versions = [bf16_weights(0)]
    stored: dict[int, bytes] = {}

    def put(data: bytes) -> int:
        stored[len(stored)] = data
        return len(stored) - 1

    assert chain.extend(0, versions[0], put) == ()  # nothing to be a delta from yet
    for v in (1, 2, 3):
        versions.append(next_version(versions[-1], v))
        links = chain.extend(v, versions[-1], put)
    assert [(link.base, link.version) for link in links] == [(1, 2), (2, 3)]  # the last two kept
    own = {n: t.clone() for n, t in versions[1].items()}
    new, changed = apply_chain(own, [decode_link(stored[link.handle]) for link in links])
    assert equal(new, versions[3]) and "bias" not in changed and new["bias"] is own["bias"]
    assert equal(own, versions[1])  # the engine's own tensors are never written
    full = sum(t.numel() * t.element_size() for t in versions[3].values())
    assert 0 < links[-1].nbytes < full / 2
    # a version with another layout starts a new chain
    assert chain.extend(4, {"other": torch.zeros(3)}, put) == ()


def test_a_wrong_base_or_a_damaged_delta_is_named_and_nothing_is_written() -> None:
    base, new = bf16_weights(0), next_version(bf16_weights(0), 1)
    deltas = [make_delta(n, base[n], new[n]) for n in base]
    wrong = dict(base, proj=base["proj"] + 1)
    with pytest.raises(DeltaError) as err:
        apply_chain(wrong, [deltas])
    assert err.value.tensor == "proj"
    unchanged_wrong = dict(base, bias=base["bias"] + 1)
    with pytest.raises(DeltaError, match="not the delta's base") as err:
        apply_chain(unchanged_wrong, [deltas])
    assert err.value.tensor == "bias"
    assert pickle.loads(pickle.dumps(err.value)).tensor == "bias"  # crosses Ray intact
    with pytest.raises(DeltaError, match="differ in names"):
        apply_chain({**base, "extra": torch.zeros(1)}, [deltas])


def test_only_objectstore_and_collective_carry_deltas() -> None:
    assert sender_options("objectstore", receivers=2, deltas=4) == {"deltas": 4}
    assert sender_options("objectstore", receivers=2) == {}
    assert sender_options("collective", receivers=2, deltas=1) == {"num_receivers": 2, "deltas": 1}
    for name in ("shm", "cudaipc"):
        with pytest.raises(ValueError, match="does not carry deltas"):
            sender_options(name, receivers=2, deltas=4)


@pytest.mark.parametrize("swap", [True, False])
def test_an_engine_behind_catches_up_through_the_deltas_and_a_joiner_gets_the_whole(
    ray_session: Any, swap: bool
) -> None:
    sender = make_sender("objectstore", "p", 1 << 20, deltas=4)
    receiver = make_receiver("objectstore")
    versions = [bf16_weights(0)]
    manifest = sender.publish(0, versions[0])
    behind = target(versions[0], 0, swap)
    for v in range(1, 4):
        versions.append(next_version(versions[-1], v))
        manifest = sender.publish(v, versions[-1])
    manifest = pickle.loads(pickle.dumps(manifest))  # as it reaches an engine
    report = receiver.receive(manifest, behind)
    assert report.applied and behind.version == 3 and equal(dict(behind.named_tensors()), versions[3])
    assert report.nbytes == sum(link.nbytes for link in manifest.deltas) < manifest.nbytes
    joiner = target({n: torch.zeros_like(t) for n, t in versions[0].items()}, -1, swap)
    report = receiver.receive(manifest, joiner)
    assert report.nbytes == manifest.nbytes and equal(dict(joiner.named_tensors()), versions[3])
    sender.close()


def test_a_delta_that_fails_its_check_falls_back_to_the_whole_version(ray_session: Any) -> None:
    sender = make_sender("objectstore", "p", 1 << 20, deltas=2)
    receiver = make_receiver("objectstore")
    v0, v1 = bf16_weights(0), next_version(bf16_weights(0), 1)
    sender.publish(0, v0)
    manifest = sender.publish(1, v1)
    corrupt = target(dict(v0, norm=v0["norm"] + 1), 0, swap=True)  # not really version 0
    with capture_logs() as logs:
        report = receiver.receive(manifest, corrupt)
    (rejected,) = [x for x in logs if x["event"] == "weights.delta_rejected"]
    assert (rejected["policy"], rejected["version"], rejected["tensor"]) == ("p", 1, "norm")
    assert report.nbytes == manifest.nbytes and equal(dict(corrupt.named_tensors()), v1)
    sender.close()
