"""Weight-sync endpoints to mix into trainer and engine Ray actors, and the driver-side orchestrator.

The driver never touches tensors: it relays one manifest per engine per sync (O(1) control messages,
whatever the parameter count) and records versions. Trainer and engine actors subclass
`TrainerWeights` / `EngineWeights`, which hold the transport's sender / receiver.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
import structlog
import torch

from polyrl_runtime.weights.api import SyncReport, TensorTarget, WeightManifest, WeightTarget
from polyrl_runtime.weights.registry import make_receiver, make_sender
from polyrl_runtime.weights.versions import VersionRegistry

log = structlog.get_logger(__name__)


class TrainerWeights:
    """Trainer side (rank 0 of the policy's trainer). Subclasses provide `weight_tensors()`."""

    def init_weight_sender(self, transport: str, policy: str, bucket_bytes: int, **kwargs: Any) -> None:
        self._weight_sender = make_sender(transport, policy, bucket_bytes, **kwargs)

    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        raise NotImplementedError

    def publish_weights(self, version: int) -> WeightManifest:
        return self._weight_sender.publish(version, self.weight_tensors())

    def wait_weights(self) -> None:
        self._weight_sender.wait()

    def set_weight_receivers(self, n: int) -> None:
        set_receivers = getattr(self._weight_sender, "set_receivers", None)
        if set_receivers is not None:
            set_receivers(n)

    def resend_weights(self) -> WeightManifest:
        resend = getattr(self._weight_sender, "resend", None)
        if resend is not None:
            manifest: WeightManifest = resend()
            return manifest
        latest = self._weight_sender.latest
        if latest is None:
            raise RuntimeError("nothing published yet")
        return latest

    def close_weights(self) -> None:
        self._weight_sender.close()


class EngineWeights:
    """Engine side. Subclasses call `init_weight_receiver` with their parameters (or a target)."""

    def init_weight_receiver(
        self, transport: str, target: WeightTarget | Mapping[str, torch.Tensor], **kwargs: Any
    ) -> None:
        self._weight_target = target if isinstance(target, WeightTarget) else TensorTarget(target)
        self._weight_receiver = make_receiver(transport, **kwargs)

    def receive_weights(self, manifest: WeightManifest) -> SyncReport:
        return self._weight_receiver.receive(manifest, self._weight_target)

    def weight_version(self) -> int:
        return self._weight_target.version


@dataclass
class SyncResult:
    manifest: WeightManifest
    reports: dict[str, SyncReport] = field(default_factory=dict)
    failures: dict[str, BaseException] = field(default_factory=dict)


class PolicyWeightSync:
    """Driver-side: one policy's trainer endpoint -> its engines, one version at a time.

    The driver calls `sync` and `add_engine`/`remove_engine` from different threads (a step's sync
    and housekeeping run concurrently); one lock keeps deliveries in version order, so a late
    joiner's catch-up can never land (or be recorded) after a newer sync.
    """

    def __init__(
        self,
        policy: str,
        trainer: Any,
        engines: Mapping[str, Any],
        registry: VersionRegistry,
        *,
        transport: str,
    ) -> None:
        self.policy = policy
        self.trainer = trainer
        self.engines = dict(engines)
        self.registry = registry
        self.transport = transport
        self._collective = transport == "collective"
        self._lock = threading.Lock()
        for name in self.engines:
            registry.join(policy, name)
        if self._collective:
            ray.get(trainer.set_weight_receivers.remote(len(self.engines)))

    def _deliver(self, manifest: WeightManifest, engines: Mapping[str, Any]) -> SyncResult:
        result = SyncResult(manifest)
        futures = {name: h.receive_weights.remote(manifest) for name, h in engines.items()}
        for name, fut in futures.items():
            try:
                report: SyncReport = ray.get(fut)
            except Exception as e:  # one engine's failure must not stop the others' bookkeeping
                result.failures[name] = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
                log.warning("weights.sync.engine_failed", policy=self.policy, engine=name, error=str(e))
                continue
            result.reports[name] = report
            self.registry.record(self.policy, name, manifest.version)
        if self._collective and (result.failures or not result.reports):
            # The sender's broadcast runs on after publish returned; the trainer must not change its
            # weights (nor start another sync) before it is done and its errors must surface. When
            # every engine received the whole version, the sender has packed and sent every byte,
            # so the extra round trip is needed only when some engine did not (its next publish
            # joins the finished sender thread anyway).
            ray.get(self.trainer.wait_weights.remote())
        return result

    def sync(self, version: int) -> SyncResult:
        with self._lock:
            manifest: WeightManifest = ray.get(self.trainer.publish_weights.remote(version))
            self.registry.publish(manifest)
            return self._deliver(manifest, self.engines)

    def add_engine(self, name: str, handle: Any) -> SyncResult | None:
        """Admit a new engine and bring it to the latest version before it gets any work."""
        # A new actor may take seconds to start: wait for it outside the lock, not in a sync's way.
        # One that died starting fails in _deliver below, which reports it like any failed engine.
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(handle.weight_version.remote())
        with self._lock:
            return self._admit(name, handle)

    def _admit(self, name: str, handle: Any) -> SyncResult | None:
        self.engines[name] = handle
        self.registry.join(self.policy, name)
        if self.registry.latest(self.policy) is None:
            if self._collective:
                ray.get(self.trainer.set_weight_receivers.remote(len(self.engines)))
            return None
        if self._collective:
            # Everyone must join the new group generation; engines already current drain the resend
            # without applying it.
            ray.get(self.trainer.set_weight_receivers.remote(len(self.engines)))
            manifest: WeightManifest = ray.get(self.trainer.resend_weights.remote())
            self.registry.publish(manifest)
            return self._deliver(manifest, self.engines)
        latest = self.registry.latest(self.policy)
        assert latest is not None
        return self._deliver(latest, {name: handle})

    def remove_engine(self, name: str) -> None:
        with self._lock:
            self.engines.pop(name, None)
            self.registry.forget(self.policy, name)
            if self._collective:
                ray.get(self.trainer.set_weight_receivers.remote(len(self.engines)))
