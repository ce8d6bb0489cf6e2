"""Transport names match the RLJob enum; `auto` picks by placement; new transports plug in by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator.api import RLJob, RLJobSpec
from polyrl_runtime.weights import (
    TRANSPORTS,
    VersionRegistry,
    choose_transport,
    choose_transports,
    get_transport,
    registered,
    sender_options,
)
from polyrl_runtime.weights.api import VersionError, WeightManifest
from polyrl_runtime.weights.buckets import plan_buckets
from polyrl_runtime.weights.registry import register_transport
from polyrl_runtime.weights.shm import ShmReceiver, ShmSender
from polyrl_testenv.bad_rljobs import base_job

REPO = Path(__file__).parents[3]


def test_every_transport_the_api_offers_is_registered() -> None:
    crd = yaml.safe_load((REPO / "manifests/base/crds/polyrl.dev_rljobs.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert tuple(spec["properties"]["weightSync"]["properties"]["transport"]["enum"]) == TRANSPORTS
    assert set(registered()) >= set(TRANSPORTS) - {"auto"}


@pytest.mark.parametrize(
    ("cuda", "same_host", "ray_available", "colocated", "expected"),
    [
        (True, True, True, False, "collective"),
        (True, False, True, False, "collective"),
        (True, True, True, True, "cudaipc"),  # rollout and trainer on one GPU pool
        (True, False, True, True, "cudaipc"),  # ... of several pods
        (False, True, True, True, "shm"),  # a colocated policy on a CPU pool
        (False, True, True, False, "shm"),
        (False, False, True, False, "objectstore"),
        (False, False, False, False, "collective"),
    ],
)
def test_auto(cuda: bool, same_host: bool, ray_available: bool, colocated: bool, expected: str) -> None:
    chosen = choose_transport(
        "auto", cuda=cuda, same_host=same_host, ray_available=ray_available, colocated=colocated
    )
    assert chosen == expected


def test_explicit_choice_is_kept_and_unknown_rejected() -> None:
    assert choose_transport("objectstore", cuda=True, same_host=True) == "objectstore"
    assert choose_transport("cudaipc", cuda=True, same_host=False) == "cudaipc"
    assert choose_transport("collective", cuda=True, same_host=True, colocated=True) == "collective"
    with pytest.raises(KeyError, match="nccl2"):
        choose_transport("nccl2", cuda=True, same_host=True)
    with pytest.raises(ValueError):
        register_transport("auto", ShmSender, ShmReceiver)


def test_sender_options_tell_only_a_sized_group_the_receiver_count() -> None:
    sized = [name for name in registered() if get_transport(name).sized_group]
    assert "collective" in sized
    for name in registered():
        expected = {"num_receivers": 3} if name in sized else {}
        if get_transport(name).at_uri:  # storage: where and how it writes versions
            expected = {"uri": "s3://b/w", "full_every": 4}
        assert sender_options(name, receivers=3, uri="s3://b/w", full_every=4) == expected


def test_register_extension() -> None:
    register_transport("test-shm-alias", ShmSender, ShmReceiver)
    assert get_transport("test-shm-alias").sender is ShmSender
    assert "test-shm-alias" in registered()


def _m(policy: str, version: int) -> WeightManifest:
    return WeightManifest(policy, version, "shm", plan_buckets([], 1))


def test_version_registry_monotone_and_readiness() -> None:
    reg = VersionRegistry()
    assert reg.latest("a") is None and reg.latest_version("a") == -1
    reg.publish(_m("a", 0))
    reg.record("a", "e0", 0)
    reg.publish(_m("a", 1))
    reg.publish(_m("b", 7))  # policies are independent
    assert reg.lagging("a") == ["e0"] and not reg.ready("a", "e0")
    reg.record("a", "e0", 1)
    assert reg.ready("a", "e0") and not reg.ready("a", "e1")
    with pytest.raises(VersionError):
        reg.publish(_m("a", 0))
    with pytest.raises(VersionError):
        reg.record("a", "e0", 0)
    reg.forget("a", "e0")
    assert reg.engines("a") == {}


def _spec(mutate: Any) -> RLJobSpec:
    doc = base_job()
    mutate(doc["spec"])
    return RLJob.model_validate(doc).spec


def _gpu_trainers(spec: dict[str, Any]) -> None:
    for p in spec["policies"]:
        p["trainer"]["gpus"] = 1


def _league_on_gpu(spec: dict[str, Any]) -> None:
    _gpu_trainers(spec)
    speaker = spec["policies"][0]
    speaker["algorithm"]["lora"] = {"rank": 4}
    speaker["league"] = {}


def _full_weight_league_on_gpu(spec: dict[str, Any]) -> None:
    _league_on_gpu(spec)
    del spec["policies"][0]["algorithm"]["lora"]


def _speaker_on_a_gpu_pool(pods: int) -> Any:
    def mutate(spec: dict[str, Any]) -> None:
        _gpu_trainers(spec)
        spec["weightSync"]["transport"] = "auto"
        spec["pools"] = [{"name": "gpus", "gpus": 2, "replicas": {"min": pods, "max": pods}}]
        speaker = spec["policies"][0]
        speaker["rollout"] = {"engine": "torch", "pool": "gpus"}
        speaker["trainer"] = {"pool": "gpus"}

    return mutate


def _shared_base_on_gpu(spec: dict[str, Any]) -> None:
    _gpu_trainers(spec)
    spec["pools"] = [{"name": "gpus", "gpus": 1}]
    for p in spec["policies"]:
        p["model"] = {"uri": "builtin://tiny-qwen2"}
        p["algorithm"]["lora"] = {"rank": 4}
        p["rollout"] = {"engine": "torch", "pool": "gpus"}


@pytest.mark.parametrize(
    ("mutate", "want"),
    [
        (lambda s: s["weightSync"].update(transport="auto"), {"speaker": "objectstore", "listener": "objectstore"}),
        (lambda s: (s["weightSync"].update(transport="auto"), _gpu_trainers(s)), {"speaker": "collective", "listener": "collective"}),
        # an engine of adapters serves several trainers' versions: never collective or cudaipc
        (lambda s: (s["weightSync"].update(transport="auto"), _league_on_gpu(s)), {"speaker": "objectstore", "listener": "collective"}),
        (lambda s: (s["weightSync"].update(transport="auto"), _shared_base_on_gpu(s)), {"speaker": "objectstore", "listener": "objectstore"}),
        # rollout and trainer on one GPU pool: device to device on one pod, through host memory on several
        (_speaker_on_a_gpu_pool(1), {"speaker": "cudaipc", "listener": "collective"}),
        (_speaker_on_a_gpu_pool(2), {"speaker": "objectstore", "listener": "collective"}),
        # a full-weight league's engine snapshots the weights it receives, by any transport
        (lambda s: (s["weightSync"].update(transport="auto"), _full_weight_league_on_gpu(s)), {"speaker": "collective", "listener": "collective"}),
    ],
)  # fmt: skip
def test_each_policy_gets_a_transport_its_engines_can_receive(mutate: Any, want: dict[str, str]) -> None:
    assert choose_transports(_spec(mutate), same_host=False) == want
