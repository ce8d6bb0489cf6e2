"""A real engine behind the `handle.generate.remote(...)` shape an `EnginePool` calls, in this
process: workflow tests drive agents against a real torch engine without starting Ray."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


class _Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self.fn(*args)


class InProcessEngine:
    """Wraps an engine object (e.g. `TorchEngine`) whose `generate` is a coroutine function."""

    def __init__(self, engine: Any) -> None:
        self.generate = _Method(engine.generate)
