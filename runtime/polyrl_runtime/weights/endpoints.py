"""The driver-side weight-sync orchestrator, over Ray; the endpoints it drives are re-exported.

The driver never touches tensors: it relays one manifest per engine per sync (O(1) control messages,
whatever the parameter count) and records versions. Trainer and engine actors subclass
`TrainerWeights` / `EngineWeights` (`weights/sides.py`, Ray-free), which hold the transport's sender /
receiver. The sync reaches them through a `WeightSource` and `WeightSinks`, the calls it makes, each
returning the call's `ObjectRef`: the trainer's and the engines' clients (trainers/client.py,
engines/client.py) are both.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import ray
import structlog

from polyrl_runtime.actors import actor_gone
from polyrl_runtime.weights.api import DeltaRejectedError, SyncReport, WeightManifest, WeightSyncError
from polyrl_runtime.weights.registry import get_transport
from polyrl_runtime.weights.sides import EngineWeights, TrainerWeights
from polyrl_runtime.weights.versions import VersionRegistry

__all__ = ["EngineWeights", "PolicyWeightSync", "SyncResult", "TrainerWeights", "WeightSink", "WeightSource"]

log = structlog.get_logger(__name__)


class WeightSource(Protocol):
    """The trainer's end of a sync (its rank 0): `TrainerWeights`' methods, called through Ray."""

    def publish_weights(self, version: int) -> ray.ObjectRef[WeightManifest]: ...

    def resend_weights(self) -> ray.ObjectRef[WeightManifest | None]: ...

    def set_weight_receivers(self, n: int) -> ray.ObjectRef[None]: ...

    def wait_weights(self) -> ray.ObjectRef[None]: ...

    def abort_weights(self) -> ray.ObjectRef[None]: ...


class WeightSink(Protocol):
    """An engine's end of a sync: `EngineWeights`' methods, called through Ray. `receive_weights`
    takes a manifest or the reference of a publish still running."""

    def receive_weights(
        self, manifest: WeightManifest | ray.ObjectRef[WeightManifest]
    ) -> ray.ObjectRef[SyncReport]: ...

    def weight_version(self) -> ray.ObjectRef[int]: ...


@dataclass
class SyncResult:
    manifest: WeightManifest
    reports: dict[str, SyncReport] = field(default_factory=dict)
    failures: dict[str, BaseException] = field(default_factory=dict)
    # Why the trainer's side of a collective failed, if it did (the engines' failures say the rest).
    sender_error: BaseException | None = None


class PolicyWeightSync:
    """Driver-side: one policy's trainer endpoint -> its engines, one version at a time.

    The driver calls `sync` and `add_engine`/`remove_engine` from different threads (a step's sync
    and housekeeping run concurrently); one lock keeps deliveries in version order, so a late
    joiner's catch-up can never land (or be recorded) after a newer sync.
    """

    def __init__(
        self,
        policy: str,
        trainer: WeightSource,
        engines: Mapping[str, WeightSink],
        registry: VersionRegistry,
        *,
        transport: str,
        admit_timeout_s: float = 600.0,
    ) -> None:
        self.policy = policy
        self.trainer = trainer
        self.engines = dict(engines)
        self.registry = registry
        self.transport = transport
        self.admit_timeout_s = admit_timeout_s
        self._collective = transport == "collective"
        self._keeps_latest = get_transport(transport).keeps_latest
        self._lock = threading.Lock()
        # Signalled after every sync, and by close(): engines waiting to be brought in by a publish.
        self._synced = threading.Condition(self._lock)
        self._syncs = 0
        self._last: SyncResult | None = None
        self._closed = False
        for name in self.engines:
            registry.join(policy, name)
        if self._collective:
            ray.get(trainer.set_weight_receivers(len(self.engines)))

    def _deliver(
        self, version: WeightManifest | ray.ObjectRef[WeightManifest], engines: Mapping[str, WeightSink]
    ) -> SyncResult:
        """Bring `engines` to `version`: a manifest already published, or a publish still running
        (its ref), whose manifest is then recorded in the registry here.

        Engines are handed a publish's ref, not its result: Ray starts their calls as soon as the
        manifest exists, instead of after it made a round trip through this thread. At 64 MiB that
        hop was a twentieth of a collective sync.
        """
        names = {engine.receive_weights(version): name for name, engine in engines.items()}
        if isinstance(version, WeightManifest):
            manifest = version
        else:
            try:
                manifest = ray.get(version)
            except BaseException:
                # The engines' calls fail with the same error without running; collect them, or
                # Ray reports each as an unhandled error.
                for ref in names:
                    with contextlib.suppress(Exception):
                        ray.get(ref, timeout=10.0)
                raise
            self.registry.publish(manifest)
        result = SyncResult(manifest)
        pending, aborted = list(names), False
        while pending:  # as they finish: a dead engine must be seen while the others still wait
            ready, pending = ray.wait(pending, num_returns=1)
            name = names[ready[0]]
            try:
                report: SyncReport = ray.get(ready[0])
            except Exception as e:  # one engine's failure must not stop the others' bookkeeping
                result.failures[name] = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
                log.warning("weights.sync.engine_failed", policy=self.policy, engine=name, error=str(e))
                if self._collective and pending and not aborted and actor_gone(e):
                    # The others may wait for bytes the dead one was to forward (see collective._wait).
                    ray.get(self.trainer.abort_weights())
                    aborted = True
                continue
            result.reports[name] = report
            self.registry.record(self.policy, name, manifest.version)
        if self._collective and (result.failures or not result.reports):
            # The sender's broadcast runs on after publish returned; the trainer must not change its
            # weights (nor start another sync) before it is done and its errors must surface. When
            # every engine received the whole version, the sender has packed and sent every byte,
            # so the extra round trip is needed only when some engine did not (its next publish
            # joins the finished sender thread anyway).
            try:
                ray.get(self.trainer.wait_weights())
            except Exception as e:
                result.sender_error = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
                log.warning("weights.sync.sender_failed", policy=self.policy, error=str(e))
        return result

    def _without_dead_engines(self, result: SyncResult) -> SyncResult:
        """Drop the engines that died from the group at once, and, when the survivors failed with
        them or could not apply the version's deltas (a collective with a dead member usually fails for every member), send them the version
        again on the new group (the trainer has not changed its weights: the driver trains the next
        step only after this sync). Without the resend, the survivors would serve the old version
        until the next step, which in sync mode waits for their samples.

        Dropped here, not left to the driver's housekeeping: a sync that ran first would build the
        next group with the dead engine in it, and a group's rendezvous waits for every member (it
        held the trainer and the survivors until the transport's timeout)."""
        dead = {n for n, e in result.failures.items() if actor_gone(e)}
        # Engines that could not apply a version sent as deltas hold their previous one: they get
        # the whole version (the sender keeps a host copy of it), on the same group.
        rejected = {n for n, e in result.failures.items() if isinstance(e, DeltaRejectedError)}
        if not dead and not rejected:
            return result
        for name in dead:
            self.engines.pop(name, None)
            self.registry.forget(self.policy, name)
        if dead:
            ray.get(self.trainer.set_weight_receivers(len(self.engines)))
        if set(result.failures) == dead:
            return result  # every survivor has the version
        resent: WeightManifest | None = ray.get(self.trainer.resend_weights())
        if resent is None:
            return result
        log.info(
            "weights.sync.resent",
            policy=self.policy,
            dead=sorted(dead),
            rejected=sorted(rejected),
            version=resent.version,
        )
        retry = self._deliver(resent, self.engines)
        retry.failures.update({n: result.failures[n] for n in dead})  # the caller still sees them
        return retry

    def sync(self, version: int) -> SyncResult:
        """Publish `version` and bring every engine to it.

        Engines that failed are in the result's `failures` (dead ones are dropped from this sync);
        raises WeightSyncError only when the trainer's side failed and no engine got the version.
        """
        with self._lock:
            result = self._deliver(self.trainer.publish_weights(version), self.engines)
            if self._collective and result.failures:
                result = self._without_dead_engines(result)
            if result.sender_error is not None and not result.reports and self.engines:
                raise WeightSyncError(
                    f"{self.policy}: no engine received version {version}: {result.sender_error}"
                ) from result.sender_error
            self._syncs += 1
            self._last = result
            self._synced.notify_all()
            return result

    def add_engine(self, name: str, engine: WeightSink) -> SyncResult | None:
        """Admit a new engine and bring it to the latest version before it gets any work.

        Returns the sync that brought it (its failures name the engine if it failed), or None when
        nothing was published yet or `close()` was called while it waited for a publish.
        """
        # A new actor may take seconds to start: wait for it outside the lock, not in a sync's way.
        # One that died starting fails in _deliver below, which reports it like any failed engine.
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(engine.weight_version())
        with self._lock:
            start = time.perf_counter()
            result = self._admit(name, engine)
        report = result.reports.get(name) if result is not None else None
        if report is not None:  # how long the engine took to catch up, and what it fetched
            log.info(
                "weights.engine_caught_up",
                policy=self.policy,
                engine=name,
                version=report.version,
                seconds=round(time.perf_counter() - start, 3),
                receive_seconds=round(report.wall_s, 3),
                bytes=report.nbytes,
                whole_bytes=result.manifest.nbytes if result is not None else 0,
            )
        return result

    def _admit(self, name: str, engine: WeightSink) -> SyncResult | None:
        self.engines[name] = engine
        self.registry.join(self.policy, name)
        if self.registry.latest(self.policy) is None:
            if self._collective:
                ray.get(self.trainer.set_weight_receivers(len(self.engines)))
            return None
        if self._collective:
            # Everyone must join the new group generation; engines already current drain the resend
            # without applying it.
            ray.get(self.trainer.set_weight_receivers(len(self.engines)))
            resent: WeightManifest | None = ray.get(self.trainer.resend_weights())
            if resent is None:
                return self._await_next_sync(name)
            self.registry.publish(resent)
            return self._deliver(resent, self.engines)
        if not self._keeps_latest:  # served from the trainer's tensors, until they change
            current: WeightManifest | None = ray.get(self.trainer.resend_weights())
            if current is None:
                return self._await_next_sync(name)
            return self._deliver(current, {name: engine})
        latest = self.registry.latest(self.policy)
        assert latest is not None
        return self._deliver(latest, {name: engine})

    def _await_next_sync(self, name: str) -> SyncResult | None:
        """The trainer's weights are already changing, so the latest version is gone from it; the
        publish that ends the step in progress (every step ends with one) goes to every engine, this
        one included. Wait for it, releasing the lock, so the caller routes work here only after."""
        seen = self._syncs
        deadline = time.monotonic() + self.admit_timeout_s
        while self._syncs == seen:
            if self._closed or name not in self.engines:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightSyncError(
                    f"{self.policy}: engine {name} joined while the trainer's weights were changing, "
                    f"and no sync brought it the new version within {self.admit_timeout_s:.0f} s"
                )
            self._synced.wait(left)
        return self._last

    def close(self) -> None:
        """Release any `add_engine` waiting for a publish (the run is over; none will come)."""
        with self._lock:
            self._closed = True
            self._synced.notify_all()

    def remove_engine(self, name: str) -> None:
        with self._lock:
            known = self.engines.pop(name, None) is not None
            self.registry.forget(self.policy, name)
            self._synced.notify_all()  # an add_engine waiting for this engine gives up
            if self._collective and known:  # a sync that saw it die has already dropped it
                ray.get(self.trainer.set_weight_receivers(len(self.engines)))
