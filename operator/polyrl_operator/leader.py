"""Leader election on a ``coordination.k8s.io/v1`` Lease, so several operator replicas are safe.

The algorithm is client-go's (what controller-runtime operators use), so admins read the Lease the
way they already do (``kubectl get lease -n polyrl-system polyrl-operator``):

* a candidate reads the Lease; it takes it when it is absent, released (no holder) or expired. Expiry
  is judged on the candidate's own monotonic clock: the record must stay unchanged for
  ``leaseDuration`` seconds since this candidate first saw it, so skewed node clocks cannot make two
  leaders. Every write carries the read ``resourceVersion``, so of two candidates racing for one
  expired Lease the API server lets exactly one win (the other gets 409 and keeps waiting);
* only the leader runs the kopf handlers. It renews every ``retryPeriod``; when no renewal has
  succeeded for ``renewDeadline`` seconds, or the Lease names another holder, it stops the handlers
  and the process exits non-zero, so the pod restarts as a standby (it never reconciles on a Lease
  it may have lost: ``renewDeadline < leaseDuration``);
* on a clean shutdown the leader releases the Lease (empty holder), so a standby takes over at
  once instead of after ``leaseDuration``;
* a standby logs what it waits for (the Lease, its holder, when it would expire) and answers the
  liveness probe itself, because kopf's probe endpoint only exists while kopf runs.

The decisions are pure functions (``observe``, ``decide``) over a typed ``LeaseRecord``; ``Elector``
does the I/O through the operator's ``KubeClient`` with merge patches (verbs: get, create, patch).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import structlog
from aiohttp import web

from polyrl_operator.kube import ApiError, Credentials, KubeClient
from polyrl_operator.settings import LeaderElection, OperatorSettings

log = structlog.get_logger("polyrl.leader")

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
LEADER_LOST_EXIT = 1
"""The process exit status after a lost Lease (non-zero: the Deployment restarts the pod)."""


class LeaderElectionError(RuntimeError):
    """Leader election cannot run (no namespace for the Lease, a refused request)."""


class LeaderLost(RuntimeError):
    """This replica no longer holds the Lease; the handlers were stopped."""


@dataclass(frozen=True)
class LeaseRecord:
    """The fields of a Lease that election reads."""

    holder: str
    lease_duration: float
    renew_time: str | None
    transitions: int
    resource_version: str

    @classmethod
    def of(cls, lease: dict[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            lease_duration=float(spec.get("leaseDurationSeconds") or 0),
            renew_time=spec.get("renewTime"),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=str((lease.get("metadata") or {}).get("resourceVersion") or ""),
        )


@dataclass(frozen=True)
class Observation:
    """A record and when (this process's monotonic clock) it was first seen unchanged."""

    record: LeaseRecord
    since: float


def observe(previous: Observation | None, record: LeaseRecord, now: float) -> Observation:
    """The new observation: the clock restarts whenever the holder renews (or another takes over)."""
    if previous is not None and (previous.record.holder, previous.record.renew_time) == (
        record.holder,
        record.renew_time,
    ):
        return Observation(record, previous.since)
    return Observation(record, now)


Action = Literal["create", "take", "renew", "wait"]


def decide(observation: Observation | None, identity: str, now: float, lease_duration: float) -> Action:
    """What a replica does with the Lease it just read (``None``: there is none)."""
    if observation is None:
        return "create"
    record = observation.record
    if record.holder == identity:
        return "renew"
    if not record.holder:
        return "take"
    duration = record.lease_duration or lease_duration
    return "take" if now - observation.since >= duration else "wait"


def lease_body(
    config: LeaderElection, identity: str, now: dt.datetime, *, previous: LeaseRecord | None
) -> dict[str, Any]:
    """The Lease's spec for a take (``previous`` not held by us) or a renewal."""
    stamp = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    spec: dict[str, Any] = {
        "holderIdentity": identity,
        "leaseDurationSeconds": max(1, round(config.lease_duration)),
        "renewTime": stamp,
    }
    if previous is None or previous.holder != identity:
        spec["acquireTime"] = stamp
        spec["leaseTransitions"] = (previous.transitions + 1) if previous and previous.holder else 0
    return {"spec": spec}


def default_identity() -> str:
    """``POD_NAME`` (or the host name) plus a random suffix: unique even across a restarted pod."""
    base = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{uuid.uuid4().hex[:8]}"


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Elector:
    """Acquire, hold and release one Lease for ``identity``."""

    def __init__(
        self,
        client: KubeClient,
        config: LeaderElection,
        namespace: str,
        identity: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.config = config
        self.identity = identity
        self.path = f"{LEASES.format(namespace=namespace)}/{config.lease_name}"
        self.where = f"Lease {namespace}/{config.lease_name}"
        self._collection = LEASES.format(namespace=namespace)
        self._clock = clock
        self._observed: Observation | None = None

    async def _read(self) -> Observation | None:
        try:
            lease = await self.client.get(self.path)
        except ApiError as exc:
            if exc.status == 404:
                self._observed = None
                return None
            raise
        self._observed = observe(self._observed, LeaseRecord.of(lease), self._clock())
        return self._observed

    async def try_acquire_or_renew(self) -> bool:
        """One round: True when this replica holds the Lease afterwards."""
        observation = await self._read()
        action = decide(observation, self.identity, self._clock(), self.config.lease_duration)
        if action == "wait":
            return False
        previous = observation.record if observation else None
        body = lease_body(self.config, self.identity, _utcnow(), previous=previous)
        try:
            if action == "create":
                name = {"name": self.config.lease_name}
                written = await self.client.create(
                    self._collection,
                    {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": name, **body},
                )
            else:
                assert previous is not None
                body["metadata"] = {"resourceVersion": previous.resource_version}
                written = await self.client.patch(self.path, body)
        except ApiError as exc:
            if exc.status == 409:  # another replica wrote first: it won this round
                return False
            raise
        # Our own write is the newest record (its resourceVersion is the next precondition).
        self._observed = observe(self._observed, LeaseRecord.of(written), self._clock())
        if action != "renew":
            log.info(
                "leader election: acquired",
                lease=self.where,
                identity=self.identity,
                previous=previous and previous.holder,
            )
        return True

    async def acquire(self) -> None:
        """Return once this replica holds the Lease; log what it waits for meanwhile."""
        last_said: tuple[str, float] | None = None
        while True:
            try:
                if await self.try_acquire_or_renew():
                    return
            except (ApiError, OSError, TimeoutError) as exc:
                log.warning(
                    "leader election: cannot read or write the Lease; retrying",
                    lease=self.where,
                    error=str(exc),
                )
            else:
                observed = self._observed
                if observed is not None:
                    holder = observed.record.holder
                    now = self._clock()
                    if last_said is None or last_said[0] != holder or now - last_said[1] >= 30:
                        duration = observed.record.lease_duration or self.config.lease_duration
                        expires = max(0.0, duration - (now - observed.since))
                        log.info(
                            "leader election: standby, waiting for the Lease",
                            lease=self.where,
                            holder=holder,
                            identity=self.identity,
                            expires_in_s=round(expires, 1),
                        )
                        last_said = (holder, now)
            await asyncio.sleep(self.config.retry_period)

    async def hold(self) -> None:
        """Renew until the Lease is lost; then raise ``LeaderLost``. Never returns normally."""
        last_renewed = self._clock()
        while True:
            await asyncio.sleep(self.config.retry_period)
            try:
                held = await asyncio.wait_for(self.try_acquire_or_renew(), self.config.renew_deadline)
            except (ApiError, OSError, TimeoutError) as exc:
                log.warning(
                    "leader election: renewal failed", lease=self.where, error=str(exc) or type(exc).__name__
                )
                held = None
            if held:
                last_renewed = self._clock()
                continue
            holder = self._observed.record.holder if self._observed else ""
            if held is False and holder and holder != self.identity:
                raise LeaderLost(f"{self.where} is now held by {holder}")
            if self._clock() - last_renewed >= self.config.renew_deadline:
                raise LeaderLost(f"{self.where} not renewed for {self.config.renew_deadline:g}s")

    async def release(self) -> None:
        """Give the Lease up (empty holder) so a standby takes over at once; best effort."""
        observation = self._observed
        if observation is None or observation.record.holder != self.identity:
            return
        body = {
            "metadata": {"resourceVersion": observation.record.resource_version},
            "spec": {
                "holderIdentity": None,
                "leaseDurationSeconds": 1,
                "renewTime": None,
                "acquireTime": None,
            },
        }
        with contextlib.suppress(ApiError, OSError, TimeoutError):
            await asyncio.wait_for(self.client.patch(self.path, body), self.config.renew_deadline)
            log.info("leader election: released", lease=self.where, identity=self.identity)


@contextlib.asynccontextmanager
async def standby_probe(liveness: str | None) -> AsyncIterator[None]:
    """Answer kopf's liveness URL (``http://HOST:PORT/PATH``) with 200 while this replica waits."""
    if not liveness:
        yield
        return
    url = urlsplit(liveness)

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"leader": False})

    app = web.Application()
    app.router.add_get(url.path or "/", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, url.hostname or "0.0.0.0", url.port or 80).start()
    try:
        yield
    finally:
        await runner.cleanup()


async def lead(
    settings: OperatorSettings,
    credentials: Credentials,
    run: Callable[[], Coroutine[Any, Any, None]],
    *,
    liveness: str | None = None,
    identity: str | None = None,
) -> int:
    """Run ``run()`` (kopf) only while this replica holds the Lease; the process exit status.

    Without ``leaderElection.enabled`` it just runs. Returns ``LEADER_LOST_EXIT`` after a lost Lease
    (the handlers are cancelled first), 0 after ``run()`` returns (the Lease is released)."""
    config = settings.leader_election
    if not config.enabled:
        await run()
        return 0
    namespace = config.lease_namespace or settings.network_policy.operator_namespace
    if not namespace:
        raise LeaderElectionError(
            "leaderElection.leaseNamespace is not set and POD_NAMESPACE is empty: "
            "name the namespace of the operator's Lease in the settings"
        )
    client = KubeClient(credentials, timeout=config.renew_deadline)
    elector = Elector(client, config, namespace, identity or default_identity())
    try:
        log.info("leader election: starting", lease=elector.where, identity=elector.identity)
        async with standby_probe(liveness):
            await elector.acquire()
        work = asyncio.create_task(run(), name="kopf")
        holding = asyncio.create_task(elector.hold(), name="lease")
        await asyncio.wait({work, holding}, return_when=asyncio.FIRST_COMPLETED)
        if holding.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            try:
                holding.result()
            except LeaderLost as exc:
                log.error(
                    "leader election: lost the Lease; stopping (the pod restarts as a standby)",
                    reason=str(exc),
                )
                return LEADER_LOST_EXIT
        holding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await holding
        await elector.release()
        await work  # re-raises what kopf raised
        return 0
    finally:
        await client.close()
