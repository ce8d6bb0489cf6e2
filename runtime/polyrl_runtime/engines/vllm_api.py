"""Every vLLM name the adapter relies on, in one table, and the pure helpers that build vLLM's inputs.

vLLM changes its Python API between minor releases and cannot be installed on CPU machines, so the
adapter (`vllm_engine.py`) and its worker extension (`vllm_worker.py`) reach vLLM only through what
`VLLM_NAMES` lists: classes and functions by import path, methods with the keyword arguments used,
and the literal values passed (`logprobs_mode="processed_logprobs"`, pause modes, finish reasons).
`tests/runtime/engines/test_vllm_contract.py` reads the pinned vLLM source releases (`VLLM_RELEASES`) with
`ast` and fails when a listed name, keyword or value is missing; it also scans the adapter's own code
so that a call on a vLLM object that is not in the table fails the test too.

Conventions the trainer assumes (see `engines/api.py`): the behaviour logprob of a token is its
log-softmax under logits / temperature over the allowed tokens. vLLM's `processed_logprobs` mode gives
exactly that (logprobs after temperature and the allowed-token mask; top-p narrows sampling but not the
recorded logprob, as in the torch engine), and `logprobs=0` returns the sampled token's only.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polyrl_operator.api.lora_serving import LORA_ENGINE_ARGS, VLLM_LORA_RANKS, vllm_lora_args
from polyrl_operator.api.policy import RESERVED_ENGINE_ARGS, Policy
from polyrl_operator.api.spec import RLJobSpec
from polyrl_runtime.engines.api import SamplingParams

# The vLLM source releases the contract test checks: (sdist URL, sha256). The `gpu` extra admits
# exactly these series. 0.32 is the one that installs beside the runtime's torch 2.13 pin (0.33 pins
# torch 2.14).
_PYPI = "https://files.pythonhosted.org/packages"
VLLM_RELEASES: dict[str, tuple[str, str]] = {
    "0.32.0": (
        f"{_PYPI}/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz",
        "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    ),
    "0.33.0": (
        f"{_PYPI}/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz",
        "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    ),
}

LOGPROBS_MODE = "processed_logprobs"
INFLIGHT_MODES = ("keep", "wait", "abort")
# `AsyncLLM.sleep`'s pause mode: requests vLLM holds finish before it sleeps (as in the torch engine).
SLEEP_PAUSE_MODE = "wait"
FINISH_REASONS = ("stop", "length", "abort")
WORKER_EXTENSION = "polyrl_runtime.engines.vllm_worker.PolyrlWorkerExtension"


@dataclass(frozen=True)
class VllmName:
    """`attr` (dotted: `Class.method`) in module `module`; `params`: keyword arguments the adapter
    passes (for a class: constructor fields); `values`: string literals it passes or compares with,
    which must appear in the definition of `attr` (a `Literal[...]` or a tuple)."""

    module: str
    attr: str
    params: tuple[str, ...] = ()
    values: tuple[str, ...] = ()


# Keys of `engine_args` / `sampling_kwargs` (their full sets, not one example; the contract test
# also calls those functions and checks what they return against these).
ENGINE_ARG_KEYS = (
    "model",
    "tensor_parallel_size",
    "dtype",
    "seed",
    "trust_remote_code",
    "logprobs_mode",
    "enable_prefix_caching",
    "worker_extension_cls",
    "gpu_memory_utilization",
    "enable_sleep_mode",
)
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "max_tokens",
    "stop_token_ids",
    "allowed_token_ids",
    "logprobs",
    "seed",
    "stop",
    "include_stop_str_in_output",
)

ASYNC_LLM = "vllm.v1.engine.async_llm"
VLLM_NAMES: tuple[VllmName, ...] = (
    VllmName("vllm.engine.arg_utils", "AsyncEngineArgs", ENGINE_ARG_KEYS + LORA_ENGINE_ARGS),
    VllmName("vllm.config.model", "LogprobsMode", values=(LOGPROBS_MODE,)),
    VllmName("vllm.config.parallel", "ParallelConfig", ("worker_extension_cls", "tensor_parallel_size")),
    VllmName(ASYNC_LLM, "AsyncLLM"),
    VllmName(ASYNC_LLM, "AsyncLLM.from_engine_args", ("engine_args",)),
    VllmName(ASYNC_LLM, "AsyncLLM.generate", ("prompt", "sampling_params", "request_id", "lora_request")),
    VllmName(ASYNC_LLM, "AsyncLLM.abort", ("request_id",)),
    VllmName(ASYNC_LLM, "AsyncLLM.pause_generation", ("mode", "clear_cache")),
    VllmName(ASYNC_LLM, "AsyncLLM.resume_generation"),
    VllmName(ASYNC_LLM, "AsyncLLM.reset_prefix_cache", ("reset_running_requests",)),
    VllmName(ASYNC_LLM, "AsyncLLM.collective_rpc", ("method", "timeout", "args", "kwargs")),
    VllmName(ASYNC_LLM, "AsyncLLM.update_weight_version", ("new_version",)),
    VllmName(ASYNC_LLM, "AsyncLLM.shutdown"),
    VllmName(ASYNC_LLM, "AsyncLLM.sleep", ("level", "mode")),
    VllmName(ASYNC_LLM, "AsyncLLM.wake_up", ("tags",)),
    # Several policies as LoRA adapters on one base (`vllm_lora.py`).
    VllmName(ASYNC_LLM, "AsyncLLM.add_lora", ("lora_request",)),
    VllmName(ASYNC_LLM, "AsyncLLM.remove_lora", ("lora_id",)),
    VllmName("vllm.lora.request", "LoRARequest", ("lora_name", "lora_int_id", "lora_path")),
    VllmName("vllm.config.lora", "MaxLoRARanks", values=tuple(str(r) for r in VLLM_LORA_RANKS)),
    VllmName("vllm.v1.engine", "PauseMode", values=(*INFLIGHT_MODES, SLEEP_PAUSE_MODE)),
    VllmName("vllm.v1.engine", "FINISH_REASON_STRINGS", values=FINISH_REASONS),
    VllmName("vllm.sampling_params", "SamplingParams", SAMPLING_KEYS),
    VllmName("vllm.outputs", "RequestOutput.outputs"),
    VllmName("vllm.outputs", "CompletionOutput.token_ids"),
    VllmName("vllm.outputs", "CompletionOutput.logprobs"),
    VllmName("vllm.outputs", "CompletionOutput.finish_reason"),
    VllmName("vllm.outputs", "CompletionOutput.stop_reason"),
    VllmName("vllm.outputs", "CompletionOutput.weight_versions"),
    VllmName("vllm.outputs", "WeightVersionSpan.version"),
    VllmName("vllm.outputs", "WeightVersionSpan.start"),
    VllmName("vllm.outputs", "WeightVersionSpan.end"),
    VllmName("vllm.logprobs", "Logprob.logprob"),
    # The worker extension (runs inside vLLM's GPU worker processes).
    VllmName("vllm.distributed.parallel_state", "get_tp_group"),
    VllmName("vllm.distributed.parallel_state", "GroupCoordinator.broadcast", ("input_", "src")),
    VllmName("vllm.distributed.parallel_state", "GroupCoordinator.rank_in_group"),
    VllmName("vllm.distributed.parallel_state", "GroupCoordinator.world_size"),
    VllmName("vllm.v1.worker.gpu_worker", "Worker.model_runner"),
    VllmName("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_model"),
    # `load_weights(weights=...)` of the model families the docs list as tested.
    VllmName("vllm.model_executor.models.llama", "LlamaForCausalLM.load_weights", ("weights",)),
    VllmName("vllm.model_executor.models.qwen2", "Qwen2ForCausalLM.load_weights", ("weights",)),
    VllmName("vllm.model_executor.models.qwen3", "Qwen3ForCausalLM.load_weights", ("weights",)),
)

# Which vLLM class each receiver name in the adapter's code holds: the contract test checks every
# attribute used on these names against `VLLM_NAMES` (`self._llm.pause_generation(...)` must be listed
# as `AsyncLLM.pause_generation`).
RECEIVERS: dict[str, str] = {
    "_llm": "AsyncLLM",
    "llm": "AsyncLLM",  # vllm_weight_rpc.py: the engine's AsyncLLM passed in
    "tp": "GroupCoordinator",
    "final": "RequestOutput",
    "completion": "CompletionOutput",
    "span": "WeightVersionSpan",
    "entry": "Logprob",
    "model_runner": "GPUModelRunner",
    "model": "LlamaForCausalLM",  # any served model; the table lists load_weights per family
}


def load(attr: str) -> Any:
    """A listed vLLM object by its table name (`AsyncLLM`, `SamplingParams`, ...)."""
    for n in VLLM_NAMES:
        if n.attr == attr:
            return getattr(importlib.import_module(n.module), attr)
    raise KeyError(f"{attr} is not in VLLM_NAMES; add it there so the contract test checks it")


class EngineArgsError(ValueError):
    """`rollout.engineArgs` sets a key the runtime owns."""


def engine_args(
    model: str,
    *,
    gpus: int,
    dtype: str,
    seed: int,
    trust_remote_code: bool,
    extra: Mapping[str, Any] | None = None,
    policy_path: str = "rollout",
    sleep_mode: bool = False,
    lora_ranks: Sequence[int] = (),
) -> dict[str, Any]:
    """Keyword arguments for `AsyncEngineArgs`: what the runtime owns, then the user's `engineArgs`
    (which vLLM validates when the engine starts). `policy_path` names the rollout in errors;
    `sleep_mode`: the rollout is on a device pool, where the engine sleeps while other roles use the
    GPUs (vLLM's sleep mode, which also switches on its CuMem allocator); `lora_ranks`: the engine
    serves adapters of these ranks, one per policy (`vllm_lora_args`, which `engineArgs` may raise:
    the API refuses values that cannot hold them)."""
    extra = dict(extra or {})
    for key in sorted(extra):
        if key in RESERVED_ENGINE_ARGS:
            raise EngineArgsError(
                f"{policy_path}.engineArgs.{key}: set by polyrl itself (from the model, gpus, seed, pool or "
                "the logprob convention); remove it"
            )
    owned: dict[str, Any] = {
        "model": model,
        "tensor_parallel_size": max(1, gpus),
        "dtype": "bfloat16" if dtype == "auto" else dtype,
        "seed": seed,
        "trust_remote_code": trust_remote_code,
        "logprobs_mode": LOGPROBS_MODE,
        "enable_prefix_caching": True,
        "worker_extension_cls": WORKER_EXTENSION,
        "gpu_memory_utilization": 0.85,
        "enable_sleep_mode": sleep_mode,
    }
    lora = vllm_lora_args(lora_ranks) if lora_ranks else {}
    return {**owned, **lora, **extra}


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments for vLLM's `SamplingParams` from ours (same meaning, vLLM's names).

    `logprobs=0`: the sampled token's logprob only. Stop strings stay in the output (their tokens
    were sampled and are trained on, see `engines/api.py`); `include_stop_str_in_output` concerns
    the text only.
    """
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_ids) or None,
        "allowed_token_ids": list(params.allowed_ids) or None,
        "logprobs": 0,
        "seed": params.seed,
        "stop": list(params.stop) or None,
        "include_stop_str_in_output": params.include_stop_str,
    }


def token_versions(spans: Sequence[tuple[str, int, int]] | None, n: int, fallback: int) -> list[int]:
    """Per-token weight versions from vLLM's `weight_versions` spans ((version label, start, end) over
    output-token indexes); tokens no span covers (vLLM labels none before the first
    `update_weight_version`) get `fallback`."""
    out = [fallback] * n
    for label, start, end in spans or ():
        try:
            version = int(label)
        except ValueError:
            continue  # vLLM's own "default" label: the weights the engine started with
        for i in range(max(0, start), min(end, n)):
            out[i] = version
    return out


def finish_reason(vllm_reason: str | None, stop_reason: object) -> tuple[str, str]:
    """(finish reason, stop string) from vLLM's: `stop` (a stop id or string), `length`, `abort`.
    `stop_reason` is the matched stop string, or the stop token id (then no string)."""
    reason = vllm_reason or "abort"
    if reason not in FINISH_REASONS:
        reason = "abort"  # "error" / "repetition": the request did not finish normally
    return reason, stop_reason if isinstance(stop_reason, str) and reason == "stop" else ""


def actor_options(spec: RLJobSpec, policy: Policy) -> dict[str, Any]:
    """The `VllmEngine` keyword arguments that come from the RLJob (beside those every engine takes)."""
    index = next(i for i, p in enumerate(spec.policies) if p.name == policy.name)
    return {
        "gpus": spec.rollout_placement(policy).gpus,
        "engine_args": dict(policy.rollout.engine_args or {}),
        "inflight": spec.weight_sync.inflight,
        "policy_path": f"spec.policies[{index}].rollout",
        "sleep_mode": policy.rollout.pool is not None,
    }
