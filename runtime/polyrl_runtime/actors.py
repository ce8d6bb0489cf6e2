"""When a failed call means its Ray actor is gone for good, not that the call itself failed.

Gone: the actor died (`RayActorError` and its subclasses), or it was never created because its node
could not set up the actor's runtime environment (`RuntimeEnvSetupError`). The e2e tier saw the
second: a worker pod's raylet got an HTTP 404 from its own runtime-env agent at start-up, so the
engine placed there never started. Every call to it failed the same way. The weight sync kept it,
and the 30 episodes routed to it failed as workflow errors, where a dead engine's episodes move on
to the policy's other engines. Everything that decides "this actor is gone" (the engine pool, the
weight sync, the driver, the producer) asks here, so the two cases are handled alike.
"""

from __future__ import annotations

import ray

ACTOR_GONE: tuple[type[Exception], ...] = (ray.exceptions.RayActorError, ray.exceptions.RuntimeEnvSetupError)


def actor_gone(error: BaseException) -> bool:
    """True when `error` (from a call to an actor) means that actor will never answer again."""
    return isinstance(error, ACTOR_GONE)
