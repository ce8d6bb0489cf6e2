"""Engine names match the RLJob enum; each names its actor class and the arguments it takes from the
job; an unknown name is refused naming the field; engine modules load only when asked for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator.api import RLJobSpec
from polyrl_runtime.engines import vllm_api
from polyrl_runtime.engines.registry import (
    ENGINES,
    UnknownEngineError,
    engine_kind,
    register_engine,
    registered,
)

REPO = Path(__file__).parents[3]


def _spec() -> RLJobSpec:
    policy: dict[str, Any] = {"model": {"uri": "builtin://tiny"}, "trainer": {"gpus": 1}}
    return RLJobSpec.model_validate(
        {
            "training": {"totalSteps": 1},
            "workflow": {"entrypoint": "m:W"},
            "policies": [
                {**policy, "name": "a", "rollout": {"engine": "torch", "gpus": 0}},
                {**policy, "name": "b", "rollout": {"engine": "vllm", "gpus": 2}},
            ],
        }
    )


def test_every_engine_the_api_offers_is_registered() -> None:
    crd = yaml.safe_load((REPO / "manifests/base/crds/polyrl.dev_rljobs.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rollout = spec["properties"]["policies"]["items"]["properties"]["rollout"]
    assert tuple(rollout["properties"]["engine"]["enum"]) == ENGINES
    assert set(registered()) >= set(ENGINES)


def test_unknown_engine_is_refused_naming_the_field() -> None:
    with pytest.raises(UnknownEngineError, match=r"rollout\.engine: unknown rollout engine 'sglang'"):
        engine_kind("sglang")


def test_torch_engine_class_and_options() -> None:
    from polyrl_runtime.engines.torch_engine import TorchEngine

    spec = _spec()
    kind = engine_kind("torch")
    assert kind.load() is TorchEngine
    assert kind.options(spec, spec.policies[0]) == {}


def test_vllm_options_come_from_the_job() -> None:
    spec = _spec()
    policy = spec.policies[1]
    assert engine_kind("vllm").options(spec, policy) == vllm_api.actor_options(spec, policy)
    assert engine_kind("vllm").options(spec, policy)["gpus"] == 2


def test_register_extension() -> None:
    class Stub:
        pass

    register_engine("test-stub", lambda: Stub)
    assert engine_kind("test-stub").load() is Stub
    assert "test-stub" in registered()


def test_engine_modules_load_only_when_asked_for() -> None:
    probe = (
        "import sys, polyrl_runtime.engines.registry\n"
        "print(sorted(m for m in ('polyrl_runtime.engines.torch_engine', "
        "'polyrl_runtime.engines.vllm_engine', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "[]"
