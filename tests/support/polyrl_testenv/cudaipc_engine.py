"""An engine in a process of its own for the `cudaipc` GPU tests (tests/runtime/gpu/test_cudaipc_cuda.py).

Started with multiprocessing's spawn context (CUDA cannot be forked), it holds CUDA tensors of its own
and applies each manifest it is sent through a `CudaIpcReceiver`, as a colocated engine does, then
answers with what it holds: each tensor's digest, its version, the receive's figures. It needs torch
and the repository's packages only (the GPU tier's machine has no Ray).
"""

from __future__ import annotations

import hashlib
import queue
from dataclasses import dataclass, field
from typing import Any

import torch

from polyrl_runtime.weights.api import TensorTarget, WeightManifest
from polyrl_runtime.weights.cudaipc import CudaIpcReceiver

Spec = list[tuple[str, tuple[int, ...], torch.dtype]]
"""The engine's tensors: (name, shape, dtype), each created on its first CUDA device."""

REPLY_TIMEOUT_S = 60.0


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in its logical (contiguous) order: equal digests, equal bits."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


@dataclass(frozen=True)
class Outcome:
    """What the engine holds after a command, and what its receive measured."""

    error: str = ""
    """``"<exception type>: <message>"`` when the command failed, else empty."""
    applied: bool = False
    version: int = -1
    updates: int = 0
    nbytes: int = 0
    wall_s: float = 0.0
    pause_s: float = 0.0
    digests: dict[str, str] = field(default_factory=dict)


def _state(target: TensorTarget, **figures: Any) -> Outcome:
    digests = {name: digest(t) for name, t in target.named_tensors().items()}
    return Outcome(version=target.version, updates=target.updates, digests=digests, **figures)


def serve(requests: Any, replies: Any) -> None:
    """The engine's loop: ("target", Spec) makes new tensors (zeros), ("receive", manifest) applies a
    version; None ends it."""
    target = TensorTarget({})
    receiver = CudaIpcReceiver()
    while (command := requests.get()) is not None:
        kind, arg = command
        try:
            if kind == "target":
                target = TensorTarget(
                    {name: torch.zeros(shape, dtype=dtype, device="cuda") for name, shape, dtype in arg}
                )
                replies.put(Outcome(version=target.version))  # zeros: no digests to take
            else:
                report = receiver.receive(arg, target)
                replies.put(
                    _state(
                        target,
                        applied=report.applied,
                        nbytes=report.nbytes,
                        wall_s=report.wall_s,
                        pause_s=report.pause_s,
                    )
                )
        except Exception as e:  # reported to the test, which asserts on it
            replies.put(_state(target, error=f"{type(e).__name__}: {e}"))
    receiver.close()


class EngineProcess:
    """The test's side: starts `serve` in a spawned process and sends it commands."""

    def __init__(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self._requests: Any = ctx.Queue()
        self._replies: Any = ctx.Queue()
        self._process = ctx.Process(target=serve, args=(self._requests, self._replies), daemon=True)
        self._process.start()

    def _ask(self, command: tuple[str, Any]) -> Outcome:
        self._requests.put(command)
        try:
            outcome: Outcome = self._replies.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            alive = self._process.is_alive()
            raise AssertionError(
                f"the engine process did not answer {command[0]!r} within {REPLY_TIMEOUT_S:g} s "
                f"({'alive' if alive else f'exit code {self._process.exitcode}'})"
            ) from None
        return outcome

    def target(self, spec: Spec) -> Outcome:
        return self._ask(("target", spec))

    def receive(self, manifest: WeightManifest) -> Outcome:
        return self._ask(("receive", manifest))

    def close(self) -> None:
        self._requests.put(None)
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
