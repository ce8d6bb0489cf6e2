"""Client-side load balancing over each policy's engines (used inside workflow workers).

Routes each request to the engine of the policy with the fewest requests this pool has in flight on
it. The driver pushes routing tables (`set_routes`) when engines join, drain or are replaced; a
draining engine simply leaves the table, so it gets no new work and finishes what it has. An engine
that dies mid-request is marked dead here, reported to the driver, and the request is retried on
another engine of the same policy (the episode continues); with none left the request fails with
`EngineUnavailableError`, which fails that episode only.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import ray
import structlog

from polyrl_runtime.engines.api import EngineUnavailableError, Generation, SamplingParams

log = structlog.get_logger(__name__)


class EnginePool:
    def __init__(self, routes: Mapping[str, Mapping[str, Any]] | None = None, retries: int = 3) -> None:
        self._routes: dict[str, dict[str, Any]] = {}
        self._in_flight: dict[str, int] = {}
        self._dead: set[str] = set()
        self.newly_dead: set[str] = set()
        self.retries = retries
        self._tiebreak = itertools.count()
        if routes:
            self.set_routes(routes)

    def set_routes(self, routes: Mapping[str, Mapping[str, Any]]) -> None:
        """policy -> {engine name: actor handle}: the engines that may get new requests."""
        self._routes = {p: dict(engines) for p, engines in routes.items()}
        live = {e for engines in self._routes.values() for e in engines}
        self._dead &= live | self._dead
        for e in live:
            self._in_flight.setdefault(e, 0)

    def outstanding(self) -> dict[str, int]:
        """Engine name -> requests sent to it and not answered yet (drain needs every caller's view)."""
        return {name: n for name, n in self._in_flight.items() if n}

    def policies(self) -> list[str]:
        return sorted(self._routes)

    def _choose(self, policy: str) -> tuple[str, Any]:
        if policy not in self._routes:
            raise EngineUnavailableError(f"unknown policy {policy!r}; known: {self.policies()}")
        candidates = [(n, h) for n, h in self._routes[policy].items() if n not in self._dead]
        if not candidates:
            raise EngineUnavailableError(f"no live engine for policy {policy!r}")
        return min(candidates, key=lambda nh: (self._in_flight.get(nh[0], 0), next(self._tiebreak)))

    async def generate(self, policy: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        last: BaseException | None = None
        for _ in range(self.retries + 1):
            name, handle = self._choose(policy)
            self._in_flight[name] = self._in_flight.get(name, 0) + 1
            try:
                result: Generation = await handle.generate.remote(prompt_ids, params)
                return result
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                log.warning("engine.dead", policy=policy, engine=name, error=str(e).splitlines()[0])
                self._dead.add(name)
                self.newly_dead.add(name)
                last = e
            finally:
                self._in_flight[name] -= 1
        raise EngineUnavailableError(f"policy {policy!r}: engines failed {self.retries + 1} times") from last

    def take_dead(self) -> set[str]:
        dead, self.newly_dead = self.newly_dead, set()
        return dead
