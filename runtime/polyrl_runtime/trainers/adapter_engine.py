"""Several policies' LoRA adapters trained on one frozen base held once (`SharedBase`), each through an
`AdapterEngine`: the part of a DeepSpeed engine's interface a trainer rank uses, for one adapter.

Policies that share a base model (`spec.sharedBases`) differ only in their adapters. A process
that trains them loads the base once and adds one peft adapter per policy (`add_adapter`, ranks,
alpha and target modules per policy). DeepSpeed's engine owns one module and one optimizer, and its
ZeRO optimizers hook every trainable parameter of that module, so two engines cannot share one
module. The adapters are small, so each policy's engine is a `FlatGradEngine` (trainers/flat_engine.py):
its own AdamW over its adapter's parameters, gradients averaged over the ranks, clipped to
`algorithm.maxGradNorm`, a non-finite step skipped, its own checkpoint files.

Only one adapter is active at a time (`SharedBase.active`, a lock): peft's `set_adapter` makes the
named adapter the one the forward uses and the only one that requires grad, so a policy's step
changes its own adapter and nothing else. Holding the lock for a whole training step keeps another
policy's step from switching the adapter under it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from polyrl_operator.api import Policy
from polyrl_runtime.trainers.build import enable_gradient_checkpointing, load_policy_model
from polyrl_runtime.trainers.flat_engine import FlatGradEngine
from polyrl_runtime.trainers.lora import LoraError, add_lora, apply_lora


class SharedBase:
    """A frozen base model with one LoRA adapter per policy (named as the policy), for one process."""

    def __init__(self, model: torch.nn.Module, policies: Sequence[Policy]) -> None:
        self.model = model
        self.policies = {p.name: p for p in policies}
        self._lock = threading.RLock()

    @classmethod
    def build(cls, policies: Sequence[Policy], *, seed: int, cuda: bool, device: torch.device) -> SharedBase:
        """Load the policies' common base once (their `model.uri` and `dtype` agree) and add each
        policy's adapter under its name."""
        if not policies:
            raise ValueError("a shared base needs at least one policy")
        first = policies[0]
        for p in policies:
            if p.algorithm.lora is None:
                raise LoraError(f"policy {p.name}: sharing a base model needs algorithm.lora")
            if (p.model.uri, p.model.dtype) != (first.model.uri, first.model.dtype):
                raise LoraError(
                    f"policy {p.name}: model {p.model.uri} ({p.model.dtype}) differs from policy "
                    f"{first.name}'s {first.model.uri} ({first.model.dtype}): they cannot share a base"
                )
        base = load_policy_model(first, seed, cuda).to(device)
        if any(p.trainer.gradient_checkpointing for p in policies):
            enable_gradient_checkpointing(base, first)
        model = apply_lora(base, first, adapter_name=first.name)
        for p in policies[1:]:
            add_lora(model, p)
        return cls(model, policies)

    @contextlib.contextmanager
    def active(self, policy: str) -> Iterator[torch.nn.Module]:
        """Within this context the model computes `policy`'s adapter, and only that adapter trains."""
        if policy not in self.policies:
            raise KeyError(f"no adapter for policy {policy!r}; this base holds {sorted(self.policies)}")
        with self._lock:
            model: Any = self.model
            model.set_adapter(policy)
            yield self.model

    def adapter_parameters(self, policy: str) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters of `policy`'s adapter, by name, in the model's order."""
        marker = f".{policy}."
        return [(n, p) for n, p in self.model.named_parameters() if ".lora_" in n and marker in n]


class AdapterEngine(FlatGradEngine):
    """One policy's adapter of a `SharedBase` as a `FlatGradEngine`. Call it inside
    `shared.active(policy)`."""

    def __init__(self, shared: SharedBase, policy: Policy, *, rank: int = 0, world: int = 1) -> None:
        named = shared.adapter_parameters(policy.name)
        if not named:
            raise LoraError(f"policy {policy.name}: the shared base holds no adapter of that name")
        super().__init__(
            policy.name,
            named,
            lr=policy.algorithm.lr,
            max_grad_norm=policy.algorithm.max_grad_norm,
            micro_batch_size=policy.trainer.micro_batch_size,
            rank=rank,
            world=world,
        )
        self.shared = shared
        self.policy = policy.name
        self.module = shared.model  # registered: parameters() and .module reach the shared model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
