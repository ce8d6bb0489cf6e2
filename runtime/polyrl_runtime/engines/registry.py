"""Rollout engines by name (the `spec.policies[].rollout.engine` enum): the actor class the fleet starts
for a policy's rollout role, and the constructor arguments that engine takes from the job.

An engine's module is imported only when that engine is asked for: `vllm` needs CUDA and the `gpu`
extra, `torch` loads torch and transformers; a process that starts no engine of a kind never imports it.

Extension point: `register_engine(name, load, options)` adds an engine without touching the callers,
which only ever name it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

from polyrl_operator.api.policy import EngineName, Policy
from polyrl_operator.api.spec import RLJobSpec
from polyrl_runtime.engines import vllm_api
from polyrl_runtime.engines.api import Engine

# The values of the RLJob API's `spec.policies[].rollout.engine`.
ENGINES: tuple[str, ...] = get_args(EngineName)

ENGINE_FIELD = "spec.policies[].rollout.engine"

EngineLoader = Callable[[], type[Engine]]
EngineOptions = Callable[[RLJobSpec, Policy], dict[str, Any]]


class UnknownEngineError(ValueError):
    """The job names an engine no module registered."""


def no_options(spec: RLJobSpec, policy: Policy) -> dict[str, Any]:
    """An engine configured entirely by the arguments every engine takes."""
    return {}


@dataclass(frozen=True)
class EngineKind:
    """One engine. `load` imports and returns its actor class. `options` gives the keyword arguments
    it takes from the job beyond those every engine takes (name, policy, model URI, transport, seed,
    dtype, trust_remote_code)."""

    name: str
    load: EngineLoader
    options: EngineOptions = no_options


_REGISTRY: dict[str, EngineKind] = {}


def register_engine(name: str, load: EngineLoader, options: EngineOptions = no_options) -> None:
    _REGISTRY[name] = EngineKind(name, load, options)


def engine_kind(name: str) -> EngineKind:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownEngineError(
            f"{ENGINE_FIELD}: unknown rollout engine {name!r}; registered: {', '.join(registered())}"
        ) from None


def registered() -> list[str]:
    return sorted(_REGISTRY)


def _torch_engine() -> type[Engine]:
    from polyrl_runtime.engines.torch_engine import TorchEngine

    return TorchEngine


def _torch_options(spec: RLJobSpec, policy: Policy) -> dict[str, Any]:
    """A full-weight league's serving copies of its snapshots (engines/full_snapshots.py)."""
    league = policy.league
    if league is None or policy.algorithm.lora is not None or spec.shared_base(policy.name) is not None:
        return {}
    return {"snapshot_slots": league.resident_snapshots or 1}


def _vllm_engine() -> type[Engine]:
    from polyrl_runtime.engines.vllm_engine import VllmEngine

    return VllmEngine


register_engine("torch", _torch_engine, _torch_options)
register_engine("vllm", _vllm_engine, vllm_api.actor_options)
