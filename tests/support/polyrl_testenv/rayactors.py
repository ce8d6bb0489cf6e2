"""Waiting for a Ray actor to be gone: `ray.kill` returns before it is, so a call made right after
can still be answered. Tests that need an actor dead before their next step use these."""

from __future__ import annotations

import time
from typing import Any

from polyrl_runtime.actors import actor_gone


def gone(handle: Any, *, tries: int = 60) -> bool:
    """True once a call to `handle` fails because the actor is gone (polls every 0.5 s)."""
    import ray

    for _ in range(tries):
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=30)
        except Exception as e:
            if actor_gone(e):
                return True
            raise
        time.sleep(0.5)
    return False


def kill(handle: Any) -> None:
    """`ray.kill` and wait until the actor is gone."""
    import ray

    ray.kill(handle)
    assert gone(handle), f"{handle} still answers 30 s after ray.kill"
