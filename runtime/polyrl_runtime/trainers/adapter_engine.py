"""Several policies' LoRA adapters trained on one frozen base held once (`SharedBase`), each through an
`AdapterEngine`: the part of a DeepSpeed engine's interface a trainer rank uses, for one adapter.

Policies that share a base model (`spec.sharedBases`) differ only in their adapters. A process
that trains them loads the base once and adds one peft adapter per policy (`add_adapter`, ranks,
alpha and target modules per policy). DeepSpeed's engine owns one module and one optimizer, and its
ZeRO optimizers hook every trainable parameter of that module, so two engines cannot share one
module. The adapters are small, so each policy's engine here is plain torch:

- its own AdamW over its adapter's parameters only (its optimizer state), and the learning rate the
  trainer sets per training step (its schedule), as with DeepSpeed (`trainers/build.py`);
- `backward` accumulates the gradients of the loss divided by the accumulation steps (as DeepSpeed's
  does); `step` counts micro-batches and, at the end of each accumulation, averages the adapter's
  gradients over the ranks (one all-reduce of one flat tensor), clips them to
  `algorithm.maxGradNorm` and steps the optimizer, unless their norm is not finite: then it skips
  the step (the adapter and its optimizer state unchanged), as every rank does, since every rank
  holds the same all-reduced gradient, and counts it in `skipped_steps` (as DeepSpeed's engine);
- checkpoints hold that adapter, its optimizer state and the trainer's client state, one file per
  rank, under `<dir>/<tag>/`.

Only one adapter is active at a time (`SharedBase.active`, a lock): peft's `set_adapter` makes the
named adapter the one the forward uses and the only one that requires grad, so a policy's step
changes its own adapter and nothing else. Holding the lock for a whole training step keeps another
policy's step from switching the adapter under it.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from polyrl_operator.api import Policy
from polyrl_runtime.trainers.build import enable_gradient_checkpointing, load_policy_model
from polyrl_runtime.trainers.lora import LoraError, add_lora, apply_lora

CHECKPOINT_FILE = "adapter-rank{rank}.pt"


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


class AdapterEngine(torch.nn.Module):
    """One policy's adapter of a `SharedBase`, with the calls a trainer rank makes on a DeepSpeed
    engine: forward, `backward`, `step`, `is_gradient_accumulation_boundary`, `skipped_steps`,
    `get_global_grad_norm`, `set_train_batch_size`, `optimizer`, `module`, `save_checkpoint`,
    `load_checkpoint`. Call it inside `shared.active(policy)`."""

    def __init__(self, shared: SharedBase, policy: Policy, *, rank: int = 0, world: int = 1) -> None:
        super().__init__()
        self.shared = shared
        self.policy = policy.name
        self.module = shared.model  # registered: parameters() and .module reach the shared model
        self.rank, self.world = rank, world
        self.params = [p for _, p in shared.adapter_parameters(policy.name)]
        if not self.params:
            raise LoraError(f"policy {policy.name}: the shared base holds no adapter of that name")
        self.optimizer = torch.optim.AdamW(self.params, lr=policy.algorithm.lr, weight_decay=0.0)
        self.max_grad_norm = policy.algorithm.max_grad_norm
        self.micro_batch_size = policy.trainer.micro_batch_size
        self.gas = 1
        self._micro = 0
        self._grad_norm: float | None = None
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite gradient

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def set_train_batch_size(self, batch_size: int) -> None:
        self.gas = max(1, batch_size // (self.micro_batch_size * self.world))

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of `loss` divided by the accumulation steps, as DeepSpeed's
        `backward` does (the trainer's loss scale counts on it)."""
        torch.autograd.backward(loss / self.gas)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step` ends the gradient accumulation (and steps the optimizer)."""
        return self._micro + 1 >= self.gas

    def step(self) -> None:
        """One micro-batch done: at the end of the gradient accumulation, average the adapter's
        gradients over the ranks, clip them and step its optimizer; or, their norm not finite, drop
        them and skip the step."""
        self._micro += 1
        if self._micro < self.gas:
            return
        self._micro = 0
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(flat)
            flat /= self.world
        norm = float(flat.norm())
        self._grad_norm = norm
        if not math.isfinite(norm):
            # Every rank holds the same all-reduced gradient, so every rank skips this step alike;
            # stepping would put NaN into the adapter and its moments for good.
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            return
        scale = 1.0
        if self.max_grad_norm > 0 and norm > self.max_grad_norm:
            scale = self.max_grad_norm / (norm + 1e-6)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = (flat[offset : offset + n] * scale).view_as(p).to(p.dtype)
            offset += n
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_global_grad_norm(self) -> float | None:
        """The norm of the last optimizer step's averaged gradients (before clipping; not finite
        when that step was skipped)."""
        return self._grad_norm

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.shared.adapter_parameters(self.policy)}

    def save_checkpoint(self, directory: str, *, tag: str, client_state: dict[str, Any], **_: Any) -> None:
        """This rank's adapter, optimizer state and `client_state` in `<directory>/<tag>/`."""
        path = Path(directory) / tag / CHECKPOINT_FILE.format(rank=self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "policy": self.policy,
            "adapter": self.adapter_state(),
            "optimizer": self.optimizer.state_dict(),
            "client_state": client_state,
        }
        torch.save(state, path)

    def load_checkpoint(self, directory: str, *, tag: str, **_: Any) -> tuple[str, dict[str, Any]]:
        """Restore what `save_checkpoint` wrote; (the file, its client state)."""
        path = Path(directory) / tag / CHECKPOINT_FILE.format(rank=self.rank)
        if not path.is_file():
            raise FileNotFoundError(f"policy {self.policy}: no adapter checkpoint at {path}")
        state = torch.load(path, map_location="cpu", weights_only=True)
        own = dict(self.shared.adapter_parameters(self.policy))
        saved: dict[str, torch.Tensor] = state["adapter"]
        if set(saved) != set(own):
            missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
            raise LoraError(
                f"policy {self.policy}: the adapter checkpoint at {path} does not match the adapter "
                f"(missing {missing[:3]}, unexpected {extra[:3]}): was algorithm.lora changed?"
            )
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(saved[name].to(p.device, p.dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        return str(path), dict(state["client_state"])
