"""A real engine behind the `handle.generate.remote(...)` shape an `EnginePool` calls, in this
process: workflow tests drive agents against a real torch engine without starting Ray
(`solver_context`: an episode whose one agent, `solver`, plays on such an engine)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polyrl_runtime.workflows.api import EpisodeContext


class _Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self.fn(*args)


class InProcessEngine:
    """Wraps an engine object (e.g. `TorchEngine`) whose `generate` is a coroutine function."""

    def __init__(self, engine: Any) -> None:
        self.generate = _Method(engine.generate)


def solver_context(uri: str, max_new_tokens: int, temperature: float = 0.0) -> EpisodeContext:
    """An episode's context with one agent, `solver`, on a `TorchEngine` of the model at `uri`."""
    from polyrl_runtime.engines.api import SamplingParams
    from polyrl_runtime.engines.pool import EnginePool
    from polyrl_runtime.engines.torch_engine import TorchEngine
    from polyrl_runtime.models import load_tokenizer
    from polyrl_runtime.workflows.api import EpisodeContext

    engine = TorchEngine("e0", "solver", uri, transport="shm", seed=1, dtype="float32")
    return EpisodeContext(
        "ep-1",
        "g-1",
        0,
        0,
        EnginePool({"solver": {"e0": InProcessEngine(engine)}}),
        {"solver": load_tokenizer(uri)},
        {"solver": SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)},
    )
