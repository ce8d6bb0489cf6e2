"""A colocated rank (trainers/colocated.py) answers every call the coordinator makes on an engine and
on a trainer rank, each the way that role's own actor answers it."""

from __future__ import annotations

import inspect

from polyrl_runtime.engines.api import Engine
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.trainers.api import TrainerRank, protocol_methods
from polyrl_runtime.trainers.colocated import ColocatedRank


def test_every_engine_and_trainer_method_is_answered_as_its_own_actor_answers_it() -> None:
    engine, trainer = protocol_methods(Engine), protocol_methods(TrainerRank)
    assert "generate_many" in engine and "train_step" in trainer
    assert not set(engine) & set(trainer)  # one name, one role
    for name in engine:
        own, here = getattr(TorchEngine, name), getattr(ColocatedRank, name)
        assert here.__name__ == name
        # A streamed call stays an async generator, a coroutine stays one, a plain call stays plain
        # (it runs on the event loop between two generation steps, as in the engine's own actor).
        assert inspect.isasyncgenfunction(here) == inspect.isasyncgenfunction(own), name
        assert inspect.iscoroutinefunction(here) == inspect.iscoroutinefunction(own), name
    for name in trainer:
        # A trainer call runs on the trainer's threads, so it never holds the generation loop.
        assert inspect.iscoroutinefunction(getattr(ColocatedRank, name)), name
