"""A real engine behind the `handle.generate.remote(...)` shape an `EngineClient` calls, in this
process: workflow tests drive agents against a real torch engine without starting Ray
(`solver_context`: an episode whose one agent, `solver`, plays on such an engine)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from polyrl_runtime.engines.api import Engine
    from polyrl_runtime.engines.client import EngineClient
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


def engine_routes(routes: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, EngineClient]]:
    """Routing tables of `EngineClient`s over engine handles or stand-ins with the handle's shape
    (`handle.<method>.remote(...)` awaitables), for an `EnginePool` in a test."""
    from polyrl_runtime.engines.client import EngineClient

    return {
        p: {n: EngineClient(cast("ActorHandle[Engine]", h)) for n, h in engines.items()}
        for p, engines in routes.items()
    }


def in_process(engine: Any) -> EngineClient:
    """An `EngineClient` whose calls run `engine`'s `generate` in this process (it has no
    `generate_many`, so the pool sends one `generate` per request)."""
    from polyrl_runtime.engines.client import EngineClient

    return EngineClient(cast("ActorHandle[Engine]", InProcessEngine(engine)))


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
        EnginePool({"solver": {"e0": in_process(engine)}}),
        {"solver": load_tokenizer(uri)},
        {"solver": SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)},
    )
