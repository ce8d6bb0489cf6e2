"""Client-side load balancing over each policy's engines (used inside workflow workers).

Routes each request to the engine of the policy with the fewest requests this pool has in flight on
it. The driver pushes routing tables (`set_routes`) when engines join, drain or are replaced; a
draining engine simply leaves the table, so it gets no new work and finishes what it has. An engine
that dies mid-request is marked dead here, reported to the driver, and the request is retried on
another engine of the same policy (the episode continues); with none left the request fails with
`EngineUnavailableError`, which fails that episode only.

Requests for the same engine issued in the same event-loop tick (an episode group's episodes make
theirs together) go out as one `generate_many` call whose answers stream back as each request
finishes (see `engines/batching.py`): a Ray call costs more CPU than the engine's work for a request
of the small models. An engine without `generate_many` gets one `generate` call per request. Routing,
in-flight counts and retries stay per request: a dead engine's unanswered requests of a call are
retried elsewhere, one by one, as before.

Every request gets an id of this pool (`SamplingParams.request_id`). A caller cancelled while its
request is on an engine (an episode past `workflow.episodeTimeoutSeconds`, or a cancelled group)
aborts it there (`Engine.abort`, the tick's aborts for an engine in one call): the engine stops it at
its next step and frees its batch slot and KV cache, instead of generating to `max_new_tokens` for
no one. A request cancelled before its tick's call went out is simply not sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import uuid
from collections.abc import Mapping

import ray
import structlog

from polyrl_runtime.actors import ACTOR_GONE
from polyrl_runtime.engines.api import EngineUnavailableError, Generation, SamplingParams
from polyrl_runtime.engines.batching import Request
from polyrl_runtime.engines.client import EngineClient

log = structlog.get_logger(__name__)

# A request is moved to another engine when its engine is gone, or unreachable for now (the pool
# does not come back to an engine it marked dead: the driver replaces it).
_ENGINE_GONE: tuple[type[Exception], ...] = (*ACTOR_GONE, ray.exceptions.ActorUnavailableError)


class EnginePool:
    def __init__(
        self, routes: Mapping[str, Mapping[str, EngineClient]] | None = None, retries: int = 3
    ) -> None:
        self._routes: dict[str, dict[str, EngineClient]] = {}
        self._in_flight: dict[str, int] = {}
        self._dead: set[str] = set()
        self.newly_dead: set[str] = set()
        self.retries = retries
        self._tiebreak = itertools.count()
        # engine name -> (engine, requests waiting for this tick's flush, their futures)
        self._batches: dict[str, tuple[EngineClient, list[Request], list[asyncio.Future[Generation]]]] = {}
        self._flush_due = False
        self._sent: set[asyncio.Future[Generation]] = set()  # flushed, not yet answered or cancelled
        self._streams: set[asyncio.Task[None]] = set()  # referenced so that they are not collected
        self._prefix = uuid.uuid4().hex[:12]  # request ids unique across the pools of every worker
        self._request_ids = itertools.count()
        # engine name -> (engine, ids of its requests to abort in this tick's call)
        self._aborts: dict[str, tuple[EngineClient, list[str]]] = {}
        self._abort_due = False
        self._abort_sends: set[asyncio.Task[None]] = set()  # abort calls not yet answered
        if routes:
            self.set_routes(routes)

    def set_routes(self, routes: Mapping[str, Mapping[str, EngineClient]]) -> None:
        """policy -> {engine name: engine}: the engines that may get new requests."""
        self._routes = {p: dict(engines) for p, engines in routes.items()}
        live = {e for engines in self._routes.values() for e in engines}
        self._dead &= live | self._dead
        for e in live:
            self._in_flight.setdefault(e, 0)

    def outstanding(self) -> dict[str, int]:
        """Engine name -> requests sent to it and not answered yet (drain needs every caller's view)."""
        return {name: n for name, n in self._in_flight.items() if n}

    async def aborts_delivered(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until the engines have taken the aborts of the callers cancelled
        so far, so that what a caller reports next (an episode's timeout) follows them: the engines'
        stats then count those requests."""
        await asyncio.sleep(0)  # the tick's `_flush_aborts`, scheduled by the cancellations, runs first
        if self._abort_sends:
            await asyncio.wait(set(self._abort_sends), timeout=timeout)

    def policies(self) -> list[str]:
        return sorted(self._routes)

    def _choose(self, policy: str) -> tuple[str, EngineClient]:
        if policy not in self._routes:
            raise EngineUnavailableError(f"unknown policy {policy!r}; known: {self.policies()}")
        candidates = [(n, h) for n, h in self._routes[policy].items() if n not in self._dead]
        if not candidates:
            raise EngineUnavailableError(f"no live engine for policy {policy!r}")
        return min(candidates, key=lambda nh: (self._in_flight.get(nh[0], 0), next(self._tiebreak)))

    async def generate(self, policy: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        # `policy`: an engine serving several policies' adapters reads it; the id names it to `abort`.
        params = dataclasses.replace(
            params, policy=policy, request_id=f"{self._prefix}-{next(self._request_ids)}"
        )
        last: BaseException | None = None
        for _ in range(self.retries + 1):
            name, engine = self._choose(policy)
            self._in_flight[name] = self._in_flight.get(name, 0) + 1
            try:
                return await self._call(name, engine, prompt_ids, params)
            except _ENGINE_GONE as e:
                log.warning("engine.dead", policy=policy, engine=name, error=str(e).splitlines()[0])
                self._dead.add(name)
                self.newly_dead.add(name)
                last = e
            finally:
                self._in_flight[name] -= 1
        raise EngineUnavailableError(f"policy {policy!r}: engines failed {self.retries + 1} times") from last

    async def _call(
        self, name: str, engine: EngineClient, prompt_ids: list[int], params: SamplingParams
    ) -> Generation:
        if not engine.streams:
            try:
                return await engine.generate(prompt_ids, params)
            except asyncio.CancelledError:
                self._abort(name, engine, params.request_id)
                raise
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Generation] = loop.create_future()
        _, requests, futures = self._batches.setdefault(name, (engine, [], []))
        requests.append((prompt_ids, params))
        futures.append(fut)
        if not self._flush_due:  # after the callbacks already queued: the rest of this tick's requests
            self._flush_due = True
            loop.call_soon(self._flush)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut in self._sent:  # on the engine: stop it there
                self._abort(name, engine, params.request_id)
            raise
        finally:
            self._sent.discard(fut)

    def _abort(self, name: str, engine: EngineClient, request_id: str) -> None:
        """Abort a sent request whose caller was cancelled, in one call with the tick's others."""
        _, ids = self._aborts.setdefault(name, (engine, []))
        ids.append(request_id)
        if not self._abort_due:
            self._abort_due = True
            asyncio.get_running_loop().call_soon(self._flush_aborts)

    def _flush_aborts(self) -> None:
        self._abort_due = False
        aborts, self._aborts = self._aborts, {}
        for name, (engine, ids) in aborts.items():
            task = asyncio.get_running_loop().create_task(self._send_abort(name, engine, ids))
            self._abort_sends.add(task)
            task.add_done_callback(self._abort_sends.discard)

    async def _send_abort(self, name: str, engine: EngineClient, request_ids: list[str]) -> None:
        try:
            await engine.abort(request_ids)
        except Exception as e:  # a dead engine generates nothing more; a failed call costs only tokens
            log.warning("engine.abort_failed", engine=name, requests=len(request_ids), error=repr(e))

    def _flush(self) -> None:
        self._flush_due = False
        batches, self._batches = self._batches, {}
        for name, (engine, requests, futures) in batches.items():
            live = [i for i, f in enumerate(futures) if not f.done()]  # a cancelled caller sends nothing
            self._sent.update(futures[i] for i in live)
            if live:
                task = asyncio.get_running_loop().create_task(
                    self._stream(name, engine, [requests[i] for i in live], [futures[i] for i in live])
                )
                self._streams.add(task)
                task.add_done_callback(self._streams.discard)

    async def _stream(
        self,
        name: str,
        engine: EngineClient,
        requests: list[Request],
        futures: list[asyncio.Future[Generation]],
    ) -> None:
        """One `generate_many` call; each answer goes to its request's future as it arrives. If the
        call fails (the engine died), its unanswered requests get the error, and `generate` retries
        each of them (on another engine when this one is dead)."""
        error: BaseException
        try:
            async for ref in engine.generate_many(requests):
                answers = await ref
                for i, answer in answers:
                    if futures[i].done():  # its caller was cancelled
                        continue
                    if isinstance(answer, BaseException):
                        futures[i].set_exception(answer)
                    else:
                        futures[i].set_result(answer)
            error = RuntimeError(f"engine {name} ended a generate_many call without answering every request")
        except asyncio.CancelledError:
            for f in futures:
                f.cancel()
            raise
        except Exception as e:
            error = e
        for f in futures:
            if not f.done():
                f.set_exception(error)

    def take_dead(self) -> set[str]:
        dead, self.newly_dead = self.newly_dead, set()
        return dead
