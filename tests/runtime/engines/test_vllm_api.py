"""The conventions the trainer assumes of every engine, and the pure helpers that give them to vLLM.

Runs on CPU: the torch engine's behaviour logprobs against the trainer's recompute over a grid of
temperatures and allowed ids, and the vLLM adapter's translation of our sampling parameters, engine
arguments, finish reasons and per-token versions (vLLM itself is checked by test_vllm_contract.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from polyrl_operator.api.policy import RESERVED_ENGINE_ARGS
from polyrl_operator.api.spec import RLJobSpec
from polyrl_runtime.algorithms.losses import TokenBatch, sequence_logprobs
from polyrl_runtime.engines import vllm_api
from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.torch_engine import TorchEngine


@pytest.mark.parametrize(
    ("temperature", "allowed"),
    [(1.0, ()), (0.7, ()), (1.6, (30, 31, 32)), (0.5, (2, 40, 41))],
)
def test_behaviour_logprobs_are_log_softmax_of_logits_over_temperature_and_allowed_ids(
    temperature: float, allowed: tuple[int, ...]
) -> None:
    """The convention `processed_logprobs` gives on vLLM, pinned on the torch engine: the trainer's
    recompute with the same temperature and allowed ids gives the engine's numbers."""
    eng = TorchEngine("e0", "p", "builtin://tiny", transport="shm", seed=5)
    prompt = [1, 10, 11, 12]
    params = SamplingParams(temperature=temperature, max_new_tokens=12, allowed_ids=allowed, seed=3)
    gen = asyncio.run(eng.generate(prompt, params))
    batch = TokenBatch.build(
        [np.asarray(prompt, dtype=np.int32)], [gen.token_ids], [np.asarray(allowed, dtype=np.int32)]
    )
    with torch.no_grad():
        want = sequence_logprobs(eng.model, batch, temperature)[0, : len(gen.token_ids)].numpy()
        untempered = sequence_logprobs(eng.model, batch, 1.0)[0, : len(gen.token_ids)].numpy()
    np.testing.assert_allclose(gen.logprobs, want, rtol=1e-4, atol=1e-5)
    if temperature != 1.0:  # the temperature is in the number (vLLM's raw_logprobs would miss it)
        assert not np.allclose(gen.logprobs, untempered, atol=1e-3)
    if allowed:
        assert set(gen.token_ids.tolist()) <= set(allowed)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (
            SamplingParams(),
            {"temperature": 1.0, "top_p": 1.0, "max_tokens": 16, "stop_token_ids": None,
             "allowed_token_ids": None, "logprobs": 0, "seed": None, "stop": None,
             "include_stop_str_in_output": False},
        ),
        (
            SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=5, stop_ids=(2,), allowed_ids=(7, 8),
                           seed=11, stop=("\n\n", "</a>"), include_stop_str=True),
            {"temperature": 0.6, "top_p": 0.9, "max_tokens": 5, "stop_token_ids": [2],
             "allowed_token_ids": [7, 8], "logprobs": 0, "seed": 11, "stop": ["\n\n", "</a>"],
             "include_stop_str_in_output": True},
        ),
        (
            SamplingParams(temperature=0.0, max_new_tokens=1),
            {"temperature": 0.0, "top_p": 1.0, "max_tokens": 1, "stop_token_ids": None,
             "allowed_token_ids": None, "logprobs": 0, "seed": None, "stop": None,
             "include_stop_str_in_output": False},
        ),
    ],
)  # fmt: skip
def test_sampling_params_translate_one_to_one(params: SamplingParams, expected: dict[str, Any]) -> None:
    assert vllm_api.sampling_kwargs(params) == expected


def test_engine_args_fix_the_conventions_and_take_the_users_extras() -> None:
    args = vllm_api.engine_args(
        "/models/m",
        gpus=2,
        dtype="auto",
        seed=7,
        trust_remote_code=False,
        extra={"max_model_len": 4096, "gpu_memory_utilization": 0.6, "enforce_eager": True},
    )
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["enable_prefix_caching"] is True
    assert args["tensor_parallel_size"] == 2
    assert args["worker_extension_cls"] == vllm_api.WORKER_EXTENSION
    assert (args["max_model_len"], args["gpu_memory_utilization"], args["enforce_eager"]) == (4096, 0.6, True)
    assert args["dtype"] == "bfloat16"
    assert args["enable_sleep_mode"] is False  # only a rollout on a device pool sleeps
    pooled = vllm_api.engine_args(
        "/m", gpus=1, dtype="auto", seed=0, trust_remote_code=False, sleep_mode=True
    )
    assert pooled["enable_sleep_mode"] is True


@pytest.mark.parametrize("key", RESERVED_ENGINE_ARGS)
def test_engine_args_refuse_keys_the_runtime_owns(key: str) -> None:
    with pytest.raises(vllm_api.EngineArgsError, match=rf"spec\.policies\[1\]\.rollout\.engineArgs\.{key}:"):
        vllm_api.engine_args(
            "/m", gpus=1, dtype="auto", seed=0, trust_remote_code=False, extra={key: 1},
            policy_path="spec.policies[1].rollout",
        )  # fmt: skip


def _spec(
    engine_args: dict[str, Any] | None, inflight: str = "keep", pool: str | None = None
) -> dict[str, Any]:
    rollout: dict[str, Any] = {"engine": "vllm", "pool": pool} if pool else {"engine": "vllm", "gpus": 2}
    if engine_args is not None:
        rollout["engineArgs"] = engine_args
    policy = {"name": "b", "model": {"uri": "builtin://tiny"}, "rollout": rollout, "trainer": {"gpus": 1}}
    spec = {
        "training": {"totalSteps": 1},
        "workflow": {"entrypoint": "m:W"},
        "policies": [{**policy, "name": "a", "rollout": {"engine": "torch", "gpus": 0}}, policy],
        "weightSync": {"inflight": inflight},
    }
    if pool:
        spec["pools"] = [{"name": pool, "replicas": {"min": 1, "max": 1}, "gpus": 2}]
    return spec


def test_the_rljob_fields_reach_the_engine() -> None:
    spec = RLJobSpec.model_validate(_spec({"max_model_len": 2048}, inflight="abort"))
    opts = vllm_api.actor_options(spec, spec.policies[1])
    assert opts == {
        "gpus": 2,
        "engine_args": {"max_model_len": 2048},
        "inflight": "abort",
        "policy_path": "spec.policies[1].rollout",
        "sleep_mode": False,
    }
    assert RLJobSpec.model_validate(_spec(None)).weight_sync.inflight == "keep"


def test_a_rollout_on_a_device_pool_starts_vllm_in_sleep_mode() -> None:
    spec = RLJobSpec.model_validate(_spec(None, pool="shared"))
    opts = vllm_api.actor_options(spec, spec.policies[1])
    assert (opts["gpus"], opts["sleep_mode"]) == (2, True)  # the pool's GPUs
    with pytest.raises(ValueError, match=r"engineArgs\.enable_sleep_mode is set by polyrl itself"):
        RLJobSpec.model_validate(_spec({"enable_sleep_mode": True}, pool="shared"))


def test_the_api_refuses_reserved_engine_args_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"policies\.1\.rollout\.engineArgs[\s\S]*engineArgs\.logprobs_mode"):
        RLJobSpec.model_validate(_spec({"logprobs_mode": "raw_logprobs"}))
    with pytest.raises(ValueError, match="inflight"):
        RLJobSpec.model_validate(_spec(None, inflight="later"))


@pytest.mark.parametrize(
    ("spans", "n", "fallback", "expected"),
    [
        (None, 3, 4, [4, 4, 4]),
        ([], 0, 4, []),
        ([("default", 0, 2), ("5", 2, 4)], 4, -1, [-1, -1, 5, 5]),  # an update in the middle
        ([("5", 0, 1), ("6", 1, 2), ("7", 2, 3)], 3, 4, [5, 6, 7]),
        ([("3", 0, 5)], 3, 0, [3, 3, 3]),  # spans past the end are clipped
    ],
)
def test_per_token_versions_from_vllms_spans(
    spans: list[tuple[str, int, int]] | None, n: int, fallback: int, expected: list[int]
) -> None:
    assert vllm_api.token_versions(spans, n, fallback) == expected


@pytest.mark.parametrize(
    ("reason", "stop_reason", "expected"),
    [
        ("stop", None, ("stop", "")),  # EOS
        ("stop", 2, ("stop", "")),  # a stop token id
        ("stop", "</a>", ("stop", "</a>")),  # a stop string
        ("length", None, ("length", "")),
        ("abort", None, ("abort", "")),
        ("error", None, ("abort", "")),
        (None, None, ("abort", "")),  # no final output: the request did not finish
    ],
)
def test_finish_reasons_are_vllms(reason: str | None, stop_reason: object, expected: tuple[str, str]) -> None:
    assert vllm_api.finish_reason(reason, stop_reason) == expected
