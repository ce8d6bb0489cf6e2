"""A trainer's parameters trained by plain torch behind the part of a DeepSpeed engine's interface a
trainer rank uses (`FlatGradEngine`): LoRA adapters on a base held once (trainers/adapter_engine.py)
and a LoRA policy's value adapter and head (trainers/value_adapter.py). DeepSpeed's engine owns one
module and one optimizer and hooks every trainable parameter of it, so two engines cannot share a
module; these parameters are small, so plain torch trains them:

- an AdamW over the given parameters only, with the learning rate the trainer sets per training step;
- `backward` accumulates the gradients of the loss divided by the accumulation steps (as DeepSpeed's
  does); `step` counts micro-batches and, at the end of each accumulation, averages the gradients
  over the ranks (one all-reduce of one flat tensor), clips them to the max norm and steps the
  optimizer, unless their norm is not finite: then it skips the step (parameters and optimizer state
  unchanged), as every rank does, since every rank holds the same all-reduced gradient, and counts it
  in `skipped_steps` (as DeepSpeed's engine);
- checkpoints hold the parameters by name, the optimizer state and the trainer's client state, one
  file per rank, under `<dir>/<tag>/`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from polyrl_runtime.trainers.lora import LoraError

CHECKPOINT_FILE = "adapter-rank{rank}.pt"


class FlatGradEngine(torch.nn.Module):
    """Parameters trained by plain torch with the calls a trainer rank makes on a DeepSpeed engine
    (forward, `backward`, `step`, `is_gradient_accumulation_boundary`, `skipped_steps`,
    `get_global_grad_norm`, `set_train_batch_size`, `optimizer`, `module`, `save_checkpoint`,
    `load_checkpoint`): an AdamW over `named` only, its gradients averaged over the ranks as one flat
    tensor, clipped and stepped at the end of each accumulation, or dropped when their norm is not
    finite (see the module docstring). `named`: the trained parameters under their checkpoint names."""

    def __init__(
        self,
        owner: str,
        named: list[tuple[str, torch.nn.Parameter]],
        *,
        lr: float,
        max_grad_norm: float,
        micro_batch_size: int,
        rank: int,
        world: int,
    ) -> None:
        super().__init__()
        self.owner = owner  # the policy, in errors
        self.named = named
        self.params = [p for _, p in named]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.rank, self.world = rank, world
        self.gas = 1
        self._micro = 0
        self._grad_norm: float | None = None
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite gradient

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
        """One micro-batch done: at the end of the gradient accumulation, average the gradients over
        the ranks, clip them and step the optimizer; or, their norm not finite, drop them and skip
        the step."""
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
            # stepping would put NaN into the parameters and their moments for good.
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
        return {n: p.detach().clone() for n, p in self.named}

    def save_checkpoint(self, directory: str, *, tag: str, client_state: dict[str, Any], **_: Any) -> None:
        """This rank's parameters, optimizer state and `client_state` in `<directory>/<tag>/`."""
        path = Path(directory) / tag / CHECKPOINT_FILE.format(rank=self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "policy": self.owner,
            "adapter": self.adapter_state(),
            "optimizer": self.optimizer.state_dict(),
            "client_state": client_state,
        }
        torch.save(state, path)

    def load_checkpoint(self, directory: str, *, tag: str, **_: Any) -> tuple[str, dict[str, Any]]:
        """Restore what `save_checkpoint` wrote; (the file, its client state)."""
        path = Path(directory) / tag / CHECKPOINT_FILE.format(rank=self.rank)
        if not path.is_file():
            raise FileNotFoundError(f"policy {self.owner}: no adapter checkpoint at {path}")
        state = torch.load(path, map_location="cpu", weights_only=True)
        own = dict(self.named)
        saved: dict[str, torch.Tensor] = state["adapter"]
        if set(saved) != set(own):
            missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
            raise LoraError(
                f"policy {self.owner}: the adapter checkpoint at {path} does not match the adapter "
                f"(missing {missing[:3]}, unexpected {extra[:3]}): was algorithm.lora changed?"
            )
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(saved[name].to(p.device, p.dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        return str(path), dict(state["client_state"])
