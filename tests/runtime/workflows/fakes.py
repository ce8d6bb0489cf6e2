"""In-process stand-ins for engine and buffer actor handles (`handle.method.remote(...)` awaitables):
tests wrap them in the clients (`EngineClient`, `BufferClient`), which call that shape."""

from __future__ import annotations

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


class FakeBuffer:
    def __init__(self) -> None:
        self.episodes: list[Any] = []
        self.released: list[Any] = []
        self.put = _Method(lambda items: self.episodes.extend(e for _, e in items))
        self.release = _Method(self.released.extend)
