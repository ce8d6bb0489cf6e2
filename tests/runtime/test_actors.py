"""`actor_gone` over real Ray actors: dead and never-started actors are gone, a failed call is not."""

from __future__ import annotations

import os
from typing import Any

import pytest

from polyrl_runtime.actors import actor_gone


class Echo:
    def echo(self, x: int) -> int:
        if x < 0:
            raise ValueError("negative")
        return x

    def die(self) -> None:
        os._exit(1)  # the process ends mid-call, so the caller's error is certain (ray.kill is asynchronous)


def _error(call: Any) -> BaseException:
    import ray

    with pytest.raises(Exception) as info:
        ray.get(call, timeout=60)
    return info.value


def test_a_failed_call_is_not_a_gone_actor_but_a_dead_or_unborn_one_is(ray_session: Any) -> None:
    ray = ray_session
    actor = ray.remote(num_cpus=0)(Echo)
    live = actor.remote()
    assert ray.get(live.echo.remote(1)) == 1
    assert not actor_gone(_error(live.echo.remote(-1)))  # the method raised; the actor serves on
    assert ray.get(live.echo.remote(2)) == 2
    assert actor_gone(_error(live.die.remote()))
    assert actor_gone(_error(live.echo.remote(3)))  # and stays gone
    unborn = actor.options(runtime_env={"conda": "polyrl-no-such-env"}).remote()
    error = _error(unborn.echo.remote(4))
    assert isinstance(error, ray.exceptions.RuntimeEnvSetupError) and actor_gone(error)
