"""A vLLM worker stand-in in a process of its own, for tests/runtime/gpu/test_vllm_worker_cudaipc.py.

Started with multiprocessing's spawn context (CUDA cannot be forked), as vLLM starts its GPU workers,
it mixes the real `PolyrlWorkerExtension` into a worker whose model is a stand-in: `load_weights`
copies each named tensor into a CUDA parameter of its own and records the batch, `named_parameters`
lists those parameters. Each command is one `polyrl_receive_ipc` call with the plain arguments the
engine sends through vLLM's `collective_rpc`; the answer is the extension's result, what the model
holds (digests) and the batches it was handed. It needs torch and the repository's packages only
(the GPU tier's machine has no vLLM or Ray).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from polyrl_runtime.engines.vllm_worker import PolyrlWorkerExtension
from polyrl_testenv.cudaipc_engine import Spec, digest

REPLY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Loaded:
    """One tensor as `load_weights` got it."""

    name: str
    nbytes: int
    device: str
    storage_offset: int
    """Bytes from the start of the tensor's storage: where it lies in the trainer's memory (a view of
    it, not a copy)."""


@dataclass(frozen=True)
class WorkerState:
    result: dict[str, Any] = field(default_factory=dict)
    """What `polyrl_receive_ipc` returned (empty for the `model` command)."""
    digests: dict[str, str] = field(default_factory=dict)
    batches: list[list[Loaded]] = field(default_factory=list)
    """Every `load_weights` call since the model was made."""


class StandInModel:
    def __init__(self, spec: Spec) -> None:
        self.params = {name: torch.zeros(shape, dtype=dtype, device="cuda") for name, shape, dtype in spec}
        self.batches: list[list[Loaded]] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        # Keeps no tensor it was handed: they are views of the trainer's memory.
        batch = []
        for name, t in weights:
            self.params[name].copy_(t)
            offset = t.data_ptr() - t.untyped_storage().data_ptr()
            batch.append(Loaded(name, t.numel() * t.element_size(), str(t.device), offset))
        self.batches.append(batch)
        return {name for name, _ in weights}

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.params.items())


class StandInWorker(PolyrlWorkerExtension):
    def __init__(self) -> None:
        self.model = StandInModel([])
        self.model_runner = SimpleNamespace(get_model=lambda: self.model)


def _state(model: StandInModel, result: dict[str, Any] | None = None) -> WorkerState:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    digests = {name: digest(t) for name, t in model.params.items()}
    return WorkerState(result or {}, digests, list(model.batches))


def serve(requests: Any, replies: Any) -> None:
    """The worker's loop: ("model", Spec) makes a new model (zeros), ("receive", kwargs) calls
    `polyrl_receive_ipc(**kwargs)`; None ends it."""
    worker = StandInWorker()
    while (command := requests.get()) is not None:
        kind, arg = command
        if kind == "model":
            worker.model = StandInModel(arg)
            replies.put(WorkerState())
        else:
            replies.put(_state(worker.model, worker.polyrl_receive_ipc(**arg)))


class WorkerProcess:
    """The test's side: starts `serve` in a spawned process and sends it commands."""

    def __init__(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self._requests: Any = ctx.Queue()
        self._replies: Any = ctx.Queue()
        self._process = ctx.Process(target=serve, args=(self._requests, self._replies), daemon=True)
        self._process.start()

    def _ask(self, command: tuple[str, Any]) -> WorkerState:
        self._requests.put(command)
        try:
            state: WorkerState = self._replies.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            alive = self._process.is_alive()
            raise AssertionError(
                f"the worker process did not answer {command[0]!r} within {REPLY_TIMEOUT_S:g} s "
                f"({'alive' if alive else f'exit code {self._process.exitcode}'})"
            ) from None
        return state

    def model(self, spec: Spec) -> WorkerState:
        return self._ask(("model", spec))

    def receive_ipc(self, **kwargs: Any) -> WorkerState:
        """`polyrl_receive_ipc(policy=, version=, handle=, layout=, timeout_s=)` in the worker."""
        return self._ask(("receive", kwargs))

    def close(self) -> None:
        self._requests.put(None)
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
