"""A shared base's trainer rank (trainers/shared_rank.py) answers every trainer call with the policy
first, and a policy's client reaches it through a handle that adds the policy's name."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

from polyrl_runtime.actors import BoundHandle, unbound
from polyrl_runtime.trainers.api import TrainerRank, protocol_methods
from polyrl_runtime.trainers.shared_rank import NO_TENSORS, UNLOCKED, SharedBaseRank


def test_every_trainer_call_is_answered_for_the_policy_it_names() -> None:
    for name in protocol_methods(TrainerRank):
        method = getattr(SharedBaseRank, name)
        assert inspect.iscoroutinefunction(method), name  # on the rank's threads, never its loop
        assert list(inspect.signature(method).parameters)[:2] == ["self", "policy"], name
    assert NO_TENSORS <= UNLOCKED <= set(protocol_methods(TrainerRank))
    assert "train_step" not in UNLOCKED and "publish_weights" not in NO_TENSORS


class _Method:
    def __init__(
        self, name: str, calls: list[tuple[Any, ...]], options: dict[str, Any] | None = None
    ) -> None:
        self.name, self.calls, self.given = name, calls, options or {}

    def remote(self, *args: Any) -> str:
        self.calls.append((self.name, self.given, *args))
        return "ref"

    def options(self, **options: Any) -> _Method:
        return _Method(self.name, self.calls, options)


class _Actor:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(name, self.calls)


def test_a_bound_handle_puts_the_policy_first_and_leaves_rays_own_calls_alone() -> None:
    actor = _Actor()
    bound: Any = BoundHandle(actor, "solver")  # type: ignore[arg-type]
    bound.train_step.remote(3, 16, 1, None)
    bound.stream.options(num_returns="streaming").remote("x")
    bound.__ray_ready__.remote()
    assert actor.calls == [
        ("train_step", {}, "solver", 3, 16, 1, None),
        ("stream", {"num_returns": "streaming"}, "solver", "x"),
        ("__ray_ready__", {}),
    ]
    assert unbound(bound) is actor and unbound(actor) is actor  # what ray.kill is given


def test_a_bound_handle_survives_pickling() -> None:
    copy = pickle.loads(pickle.dumps(BoundHandle(["an actor"], "verifier")))  # type: ignore[arg-type]
    assert copy.actor == ["an actor"] and copy.first == "verifier"
