"""An optimizer step whose gradient is not finite is skipped, by every rank of the policy alike.

A NaN or infinite gradient that reaches the optimizer puts NaN into the weights and into Adam's
moments for good. DeepSpeed skips such a step on its own only in some configurations (0.19: its
ZeRO-1..3 and mixed-precision wrappers check the reduced gradients, but ZeRO stage 0 in fp32 steps
the client optimizer unchecked), so the trainer decides itself, the same way for every stage:

- `GradientWatch` sees the gradient each backward computes for each trainable parameter, on the
  rank that computes it, before anything reduces it: a tensor hook runs before the gradient is
  accumulated into `.grad`, so before DeepSpeed's own hooks reduce or partition it (under ZeRO-2/3
  `.grad` is gone by the end of the backward, so it cannot be read afterwards). Every element of
  the gradient the optimizer applies is a sum, over the ranks and the micro-batches, of such local
  gradients, and a sum of finite values is finite unless it overflows (a norm beyond float32's
  range), which DeepSpeed's ZeRO check reports as an invalid norm; that skip is counted too.
- the micro-batches' losses: a non-finite loss makes the step's gradient meaningless even where it
  happens to be finite (a NaN term without gradient).
- at the accumulation boundary, before `engine.step()`, the ranks all-reduce what they saw, so they
  all decide alike; then `suppressed_step` makes the client optimizer's `step` a no-op for that one
  `engine.step()`. DeepSpeed still runs its whole boundary (reduction, clipping, `zero_grad`,
  freeing its partitions' gradients, `micro_steps` and `global_steps`), so its state stays
  consistent and the next step is a normal one. Only the client optimizer's step writes the
  weights and the moments (ZeRO then copies its fp32 partitions, unchanged, back into the model's
  parameters), so both stay exactly what they were.

fp16 is the exception: DeepSpeed's dynamic loss scaler overflows fp16 gradients on purpose, skips
those steps and lowers the scale, so under fp16 only the losses are checked and the scaler's own
skips are not counted as non-finite gradients.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)


class GradientWatch:
    """The sum of the norms of the local gradients the backwards compute for `params` since the last
    `reset`: finite exactly when every one of them is (and their sum fits in float32). One device
    scalar, read once per optimizer step: the hooks never wait for the device."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self._total: torch.Tensor | None = None
        # torch's `register_hook` is untyped
        self._handles: list[Any] = [
            p.register_hook(self._see)  # type: ignore[no-untyped-call]
            for p in params
            if p.requires_grad
        ]

    def _see(self, grad: torch.Tensor) -> None:
        # Returns None: the gradient goes on unchanged.
        norm = torch.linalg.vector_norm(grad.detach(), dtype=torch.float32)
        self._total = norm if self._total is None else self._total + norm

    def total(self) -> float:
        return 0.0 if self._total is None else float(self._total)

    def reset(self) -> None:
        self._total = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _unchanged(*_: Any, **__: Any) -> None:
    return None


@contextlib.contextmanager
def suppressed_step(optimizer: torch.optim.Optimizer, suppress: bool = True) -> Iterator[None]:
    """Within this context (when `suppress`) the optimizer's `step` changes nothing: no parameter,
    no moment, no step count. An instance attribute shadows the class's method, so whoever calls
    `optimizer.step()` (DeepSpeed's engine or its ZeRO wrapper) gets the no-op; the optimizer's
    type is left alone (ZeRO checks it against the optimizers it supports)."""
    if not suppress:
        yield
        return
    target: Any = optimizer
    target.step = _unchanged
    try:
        yield
    finally:
        del target.step


class StepGuard:
    """A trainer rank's optimizer steps (`engine.step()` calls) within one training step: each one at
    an accumulation boundary is skipped when any rank saw a non-finite loss or gradient since the
    previous one (see the module docstring).

    `engine`: DeepSpeed's engine or one with its interface (`is_gradient_accumulation_boundary`,
    `step`, `skipped_steps`, `get_global_grad_norm`); `optimizer`: the optimizer whose step writes
    the weights; `watch`: the rank's gradients, or None where the engine checks its reduced
    gradient itself (trainers/adapter_engine.py); `loss_scaled`: fp16 (its scaler's skips are not
    counted); `allreduce`: sums a list of floats over the policy's ranks (NaN and inf survive a sum)."""

    def __init__(
        self,
        engine: Any,
        optimizer: torch.optim.Optimizer,
        *,
        watch: GradientWatch | None,
        loss_scaled: bool,
        allreduce: Callable[[list[float]], list[float]],
    ) -> None:
        self.engine, self.optimizer, self.watch = engine, optimizer, watch
        self.loss_scaled, self.allreduce = loss_scaled, allreduce
        self.begin()

    @classmethod
    def of(
        cls,
        engine: Any,
        optimizer: torch.optim.Optimizer,
        config: Mapping[str, Any],
        *,
        watch_gradients: bool,
        allreduce: Callable[[list[float]], list[float]],
    ) -> StepGuard:
        """The guard of an engine built with the DeepSpeed `config` ({} for none): its gradients
        watched when `watch_gradients`, but under fp16 (the loss scaler overflows them on purpose)."""
        fp16 = bool(config.get("fp16", {}).get("enabled", False))
        watch = GradientWatch(engine.module.parameters()) if watch_gradients and not fp16 else None
        return cls(engine, optimizer, watch=watch, loss_scaled=fp16, allreduce=allreduce)

    def begin(self) -> None:
        """A new training step: no step taken or skipped yet."""
        self.skipped = 0  # optimizer steps skipped for a non-finite gradient
        self.steps = 0  # optimizer steps (boundaries) taken or skipped
        self.skipped_norm: float | None = None  # the norm of the latest step skipped
        self._last_skipped = False  # whether the latest step was
        self._losses_finite = True
        if self.watch is not None:
            self.watch.reset()

    def loss(self, value: float) -> None:
        """A micro-batch's loss, before its `step`."""
        self._losses_finite = self._losses_finite and math.isfinite(value)

    def step(self, *, trains: bool = True) -> None:
        """`engine.step()` after a micro-batch's backward (a collective at an accumulation boundary:
        call it on every rank alike). `trains`: whether the optimizer step has anything to train on,
        the same on every rank; one that has not (no rank had a row of its mini-batch) runs the
        boundary with the optimizer's step suppressed, since a zero gradient would still move the
        weights by the optimizer's momentum; it is not counted as skipped."""
        engine = self.engine
        if not engine.is_gradient_accumulation_boundary():
            engine.step()
            return
        grads = self.watch.total() if self.watch is not None else 0.0
        bad_losses, grads = self.allreduce([0.0 if self._losses_finite else 1.0, grads])
        skip = bad_losses > 0 or not math.isfinite(grads)
        before = int(engine.skipped_steps)
        with suppressed_step(self.optimizer, skip or not trains):
            engine.step()
        # The engine's own skip: DeepSpeed's ZeRO saw an invalid norm, or the adapter engine a
        # non-finite all-reduced gradient (fp16: its loss scaler's routine overflow, not counted).
        own = int(engine.skipped_steps) > before and not self.loss_scaled
        self.steps += 1
        self._losses_finite = True
        if self.watch is not None:
            self.watch.reset()
        self._last_skipped = skip or own
        if not self._last_skipped:
            return
        self.skipped += 1
        norm = engine.get_global_grad_norm()
        if norm is not None and not math.isfinite(float(norm)):
            self.skipped_norm = float(norm)
        else:  # the engine computed none (ZeRO-0 fp32), or a finite one of a non-finite loss
            self.skipped_norm = grads if not math.isfinite(grads) else math.nan

    def grad_norm(self) -> float:
        """The norm of the step's last optimizer step, as the engine reports it (not finite when it
        was skipped, or an fp16 loss scaler's overflow); 0.0 when the engine reports none (DeepSpeed's
        ZeRO stage 0 in fp32 keeps no norm)."""
        if self._last_skipped and self.skipped_norm is not None:
            return self.skipped_norm
        norm = self.engine.get_global_grad_norm()
        return 0.0 if norm is None else float(norm)

    def log_skips(self, **context: Any) -> None:
        """Log the training step's skipped optimizer steps, if any (`context`: policy, step, rank)."""
        if self.skipped:
            log.warning(
                "trainer.optimizer_step_skipped",
                **context,
                skipped=self.skipped,
                optimizer_steps=self.steps,
                grad_norm=self.skipped_norm,
                why="a loss or the gradient norm was not finite: weights and optimizer state unchanged",
            )
