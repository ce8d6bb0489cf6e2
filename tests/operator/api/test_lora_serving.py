"""vLLM engine arguments for policies served as LoRA adapters on one base (`api/lora_serving.py`): the
ones polyrl sets, and `engineArgs` values that cannot hold the adapters on the pool, refused by
`polyrl validate` with the file and field named (engineArgs is free-form, so the API server leaves it
to this check, as it does the reserved keys)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator.api import RLJobSpec
from polyrl_operator.api.lora_serving import vllm_lora_args
from polyrl_operator.validation import validate_file
from polyrl_testenv.bad_rljobs import Doc, base_job


def _shared_on_vllm(ranks: tuple[int, int] = (8, 16), engine_args: dict[str, Any] | None = None) -> Doc:
    """Both policies of the base job as LoRA adapters on one vLLM engine of GPU pool `shared`."""
    doc = base_job()
    doc["spec"]["pools"] = [{"name": "shared", "gpus": 1, "replicas": {"min": 1, "max": 1}}]
    for policy, rank in zip(doc["spec"]["policies"], ranks, strict=True):
        policy["model"] = {"uri": "builtin://tiny-qwen2", "dtype": "bfloat16"}
        policy["algorithm"]["lora"] = {"rank": rank}
        policy["rollout"] = {"engine": "vllm", "pool": "shared"}
        if engine_args is not None:
            policy["rollout"]["engineArgs"] = engine_args
    return doc


def _problems(tmp_path: Path, doc: Doc) -> dict[str, str]:
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump(doc))
    return {p.path: p.message for p in validate_file(file).problems}


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ([16, 16], {"enable_lora": True, "max_loras": 4, "max_cpu_loras": 4, "max_lora_rank": 16}),
        ([4, 9, 2], {"enable_lora": True, "max_loras": 6, "max_cpu_loras": 6, "max_lora_rank": 16}),
        ([300], {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 2, "max_lora_rank": 320}),
        ([1], {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 2, "max_lora_rank": 1}),
    ],
)
def test_the_engine_arguments_polyrl_sets_for_the_adapters(
    ranks: list[int], expected: dict[str, Any]
) -> None:
    assert vllm_lora_args(ranks) == expected


def test_a_vllm_shared_base_with_room_for_its_adapters_is_valid(tmp_path: Path) -> None:
    assert _problems(tmp_path, _shared_on_vllm()) == {}
    assert _problems(tmp_path, _shared_on_vllm(engine_args={"max_loras": 2, "max_lora_rank": 64})) == {}
    spec = RLJobSpec.model_validate(_shared_on_vllm()["spec"])
    assert [b.policies for b in spec.shared_bases()] == [tuple(p.name for p in spec.policies)]


@pytest.mark.parametrize(
    ("ranks", "engine_args", "field", "hint"),
    [
        (
            (8, 16),
            {"max_loras": 1},
            "spec.policies[0].rollout.engineArgs.max_loras",
            "at least 2, the number of",
        ),
        ((8, 16), {"max_cpu_loras": 1}, "spec.policies[0].rollout.engineArgs.max_cpu_loras", "at least 2"),
        (
            (8, 16),
            {"max_lora_rank": 8},
            "spec.policies[0].rollout.engineArgs.max_lora_rank",
            "at least 16, the largest",
        ),
        ((8, 16), {"max_loras": "4"}, "spec.policies[0].rollout.engineArgs.max_loras", "an integer"),
        (
            (8, 16),
            {"enable_lora": False},
            "spec.policies[0].rollout.engineArgs.enable_lora",
            "leave it unset or true",
        ),
        ((8, 1024), None, "spec.policies[1].algorithm.lora.rank", "the largest LoRA rank vLLM serves"),
    ],
)
def test_engine_args_that_cannot_hold_the_adapters_are_refused_naming_the_field(
    tmp_path: Path, ranks: tuple[int, int], engine_args: dict[str, Any] | None, field: str, hint: str
) -> None:
    problems = _problems(tmp_path, _shared_on_vllm(ranks, engine_args))
    assert field in problems, problems
    assert hint in problems[field], problems[field]


def test_the_torch_engine_takes_no_vllm_arguments(tmp_path: Path) -> None:
    doc = _shared_on_vllm((8, 1024))
    for policy in doc["spec"]["policies"]:
        policy["rollout"]["engine"] = "torch"
    doc["spec"]["pools"][0]["gpus"] = 0
    assert _problems(tmp_path, doc) == {}  # the torch engine serves any rank


def test_a_frozen_member_of_a_vllm_shared_base_takes_no_lora_slot(tmp_path: Path) -> None:
    """A frozen policy on the base is served the base alone: the room asked of vLLM counts the
    trained policies' adapters only, and its own engineArgs are held to that room."""
    doc = _shared_on_vllm()
    judge = {
        "name": "judge",
        "frozen": True,
        "model": {"uri": "builtin://tiny-qwen2", "dtype": "bfloat16"},
        "rollout": {"engine": "vllm", "pool": "shared", "engineArgs": {"max_loras": 2}},
    }
    doc["spec"]["policies"].append(judge)
    spec = RLJobSpec.model_validate(doc["spec"])
    (base,) = spec.shared_bases()
    assert (base.trained, base.frozen) == (("speaker", "listener"), ("judge",))
    assert _problems(tmp_path, doc) == {}  # two slots hold the two adapters
    judge["rollout"]["engineArgs"] = {"max_loras": 1}
    problems = _problems(tmp_path, doc)
    assert "at least 2" in problems["spec.policies[2].rollout.engineArgs.max_loras"], problems
    assert "the adapters of speaker, listener " in problems["spec.policies[2].rollout.engineArgs.max_loras"]
    # One LoRA policy and a frozen one: one slot is room enough.
    del doc["spec"]["policies"][1]
    judge["rollout"]["engineArgs"] = {"max_loras": 1, "max_cpu_loras": 1}
    assert _problems(tmp_path, doc) == {}
