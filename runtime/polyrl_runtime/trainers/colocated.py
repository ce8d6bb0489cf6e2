"""A CPU policy's trainer rank and its first rollout engine in one process (`polyrl run`).

Under `polyrl run` every actor shares one host. On CPU each actor's process pays for its imports
(Ray's worker, torch, transformers' model code, about 3.5 CPU-seconds) before it does anything, and
on a laptop's few cores that is most of a job's start-up. A policy whose trainer is one rank and
whose rollout is the torch engine on CPU, on no pool, therefore gets both in one actor
(`ColocatedRank`, chosen by `coordinator.placement.colocated_policies`), as verl's hybrid workers hold
rollout and training together:

- the engine serves on the actor's event loop, exactly as it does alone;
- the trainer's calls run on two threads of their own (the concurrency a trainer rank actor has), so
  a training step never holds the generation loop: torch releases the GIL in its kernels, so the
  two overlap as two processes would in async mode;
- each keeps its own model, and a new version goes from one to the other through the policy's
  weight transport, as between two processes (the object store hands it over without a copy).

The actor answers every method of `engines.api.Engine` and of `trainers.api.TrainerRank` (tested),
so its handle goes to an `EngineClient` and a `TrainerRankClient` alike. One process means one
failure domain: if it dies, the policy's trainer and that engine are lost together, as a node's
loss takes both.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from polyrl_runtime.engines.api import Engine
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.trainers.api import RANK_CONCURRENCY, TrainerRank, protocol_methods
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer


class ColocatedRank:
    """Rank 0 of a one-rank trainer and a torch engine of the same policy, in one actor. `engine` and
    `trainer` build each part with the arguments the fleet gives a separate actor of that role."""

    def __init__(self, engine: Callable[[], Engine], trainer: Callable[[], DeepSpeedTrainer]) -> None:
        self._trainer = trainer()  # cheap: its model is built in `setup`
        self._engine = engine()
        self._threads = ThreadPoolExecutor(RANK_CONCURRENCY, thread_name_prefix="trainer")


def _engine_method(name: str) -> Callable[..., Any]:
    """`name` of the engine, called as the engine's own method is (on the event loop)."""
    own = getattr(TorchEngine, name)
    if inspect.isasyncgenfunction(own):

        async def streamed(self: ColocatedRank, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            async for item in getattr(self._engine, name)(*args, **kwargs):
                yield item

        method: Callable[..., Any] = streamed
    elif inspect.iscoroutinefunction(own):

        async def awaited(self: ColocatedRank, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self._engine, name)(*args, **kwargs)

        method = awaited
    else:

        def direct(self: ColocatedRank, *args: Any, **kwargs: Any) -> Any:
            return getattr(self._engine, name)(*args, **kwargs)

        method = direct
    return _named(method, name, own)


def _trainer_method(name: str) -> Callable[..., Any]:
    """`name` of the trainer, run on the trainer's threads (a step takes seconds of CPU)."""
    own = getattr(DeepSpeedTrainer, name)

    async def threaded(self: ColocatedRank, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(getattr(self._trainer, name), *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._threads, call)

    return _named(threaded, name, own)


def _named(method: Callable[..., Any], name: str, own: Callable[..., Any]) -> Callable[..., Any]:
    method.__name__ = method.__qualname__ = name
    method.__doc__ = own.__doc__
    return method


for _name in protocol_methods(Engine):
    setattr(ColocatedRank, _name, _engine_method(_name))
for _name in protocol_methods(TrainerRank):
    setattr(ColocatedRank, _name, _trainer_method(_name))
