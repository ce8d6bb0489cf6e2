"""What one vLLM engine serving several policies as LoRA adapters on a shared base (`RLJobSpec.shared_bases`)
needs from vLLM: LoRA on, and room for the adapters of the policies placed on its pool.

The runtime sets these `AsyncEngineArgs` itself (`vllm_lora_args`): `enable_lora`, `max_loras` and
`max_cpu_loras` at twice the number of policies (during an update a policy's old version finishes the
requests it started beside the new one), and `max_lora_rank`, the largest rank among them rounded up to a
rank vLLM supports. A user's `rollout.engineArgs` may raise them; a value that cannot hold the adapters is
refused naming the field (`lora_serving_problems`), as vLLM would refuse it only once the engine starts.
A frozen policy of a shared base takes no LoRA slot: its requests carry no `LoRARequest`, which vLLM
serves with the base model alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polyrl_operator.api.policy import Policy
from polyrl_operator.api.pools import SharedBase

# The ranks vLLM can serve (`vllm.config.lora.MaxLoRARanks`; the contract test checks them against the
# pinned vLLM releases).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

LORA_ENGINE_ARGS = ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank")


def vllm_lora_args(ranks: Sequence[int]) -> dict[str, Any]:
    """The engine arguments for the adapters of `ranks` (one per policy) on one vLLM engine."""
    largest = max(ranks)
    rank = next((r for r in VLLM_LORA_RANKS if r >= largest), largest)
    return {
        "enable_lora": True,
        "max_loras": 2 * len(ranks),
        "max_cpu_loras": 2 * len(ranks),
        "max_lora_rank": rank,
    }


def lora_serving_problems(policies: Sequence[Policy], bases: Sequence[SharedBase]) -> list[tuple[str, str]]:
    """(field path under spec, message) for each engineArgs value or adapter rank a vLLM engine of a
    shared base (`RLJobSpec.shared_bases`) cannot serve; [] when every shared base fits. The room
    needed counts the trained members' adapters; every member's engineArgs is checked against it."""
    out: list[tuple[str, str]] = []
    index = {p.name: i for i, p in enumerate(policies)}
    by_name = {p.name: p for p in policies}
    for base in bases:
        members = [by_name[n] for n in base.policies]
        adapters = [by_name[n] for n in base.trained]
        if members[0].rollout.engine != "vllm":
            continue
        for p in adapters:
            assert p.algorithm.lora is not None  # a shared base's trained members set algorithm.lora
            if p.algorithm.lora.rank > VLLM_LORA_RANKS[-1]:
                out.append(
                    (
                        f"policies[{index[p.name]}].algorithm.lora.rank",
                        f"{p.algorithm.lora.rank} is above {VLLM_LORA_RANKS[-1]}, the largest LoRA rank vLLM serves",
                    )
                )
        ranks = [p.algorithm.lora.rank for p in adapters if p.algorithm.lora is not None]
        need = {"max_loras": len(adapters), "max_cpu_loras": len(adapters), "max_lora_rank": max(ranks)}
        served = ", ".join(base.trained)
        for p in members:
            args = p.rollout.engine_args or {}
            where = f"policies[{index[p.name]}].rollout.engineArgs"
            if "enable_lora" in args and args["enable_lora"] is not True:
                out.append(
                    (
                        f"{where}.enable_lora",
                        f"policies {served} are served as LoRA adapters: leave it unset or true",
                    )
                )
            for key, least in need.items():
                value = args.get(key)
                if value is None:
                    continue
                if not isinstance(value, int) or isinstance(value, bool) or value < least:
                    what = "the largest rank among" if key == "max_lora_rank" else "the number of"
                    out.append(
                        (
                            f"{where}.{key}",
                            f"{value!r} cannot hold the adapters of {served} (one vLLM engine on "
                            f"pool {base.pool}): it must be an integer of at least {least}, {what} them",
                        )
                    )
    return out
