"""In-process stand-ins for engine and buffer actor handles (`handle.method.remote(...)` awaitables):
tests wrap them in the clients (`EngineClient`, `BufferClient`), which call that shape."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from polyrl_runtime.engines.api import Generation, SamplingParams


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    async def _call(self, *args: Any) -> Any:
        return self.fn(*args)

    def remote(self, *args: Any) -> Any:
        return self._call(*args)


class FakeEngine:
    """Answers with `policy_fn(prompt_ids, params) -> list of token ids` (or raises)."""

    def __init__(self, policy_fn: Callable[[list[int], SamplingParams], list[int]], version: int = 0) -> None:
        self.calls = 0

        def generate(prompt: list[int], params: SamplingParams) -> Generation:
            self.calls += 1
            ids = policy_fn(prompt, params)
            return Generation(
                np.array(ids, dtype=np.int32),
                np.full(len(ids), -0.5, dtype=np.float32),
                np.full(len(ids), version, dtype=np.int32),
                "length",
            )

        self.generate = _Method(generate)


class _Detached:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        task = asyncio.ensure_future(self.fn(*args))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        return asyncio.shield(task)


class DetachedEngine:
    """A real engine (e.g. `TorchEngine`) behind the handle shape whose calls run as tasks of their
    own, as a Ray actor's do: cancelling the caller's await leaves the engine's `generate` running
    (awaiting an ObjectRef does not cancel the actor's call), so only `abort` stops it."""

    def __init__(self, engine: Any) -> None:
        self.generate = _Detached(engine.generate)
        self.abort = _Detached(engine.abort)


class FakeBuffer:
    def __init__(self) -> None:
        self.episodes: list[Any] = []
        self.released: list[Any] = []
        self.put = _Method(lambda items: self.episodes.extend(e for _, e in items))
        self.release = _Method(self.released.extend)
