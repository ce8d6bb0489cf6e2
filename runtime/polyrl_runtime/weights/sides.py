"""The trainer's and the engine's ends of weight sync: mixins holding the transport's sender and
receiver. Ray-free: an engine or trainer runs in-process without Ray too (the driver's orchestrator,
which calls them through Ray, is `weights/endpoints.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from polyrl_runtime.weights.api import SyncReport, TensorTarget, WeightManifest, WeightTarget
from polyrl_runtime.weights.registry import make_receiver, make_sender


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

    def abort_weights(self) -> None:
        """Abort the collective sync in flight (an engine of its group died)."""
        abort = getattr(self._weight_sender, "abort", None)
        if abort is not None:
            abort()

    def begin_weight_update(self) -> None:
        """Call before changing the tensors `weight_tensors()` returns (an optimizer step, a load).

        A transport that sends straight from them first finishes sending; engines joining after this
        are brought to the new version by its publish instead of being sent the old one.
        """
        sender = getattr(self, "_weight_sender", None)
        if sender is not None:
            sender.release_source()

    def set_weight_receivers(self, n: int) -> None:
        set_receivers = getattr(self._weight_sender, "set_receivers", None)
        if set_receivers is not None:
            set_receivers(n)

    def resend_weights(self) -> WeightManifest | None:
        """The latest version for engines that just joined; None when only the next publish can
        bring it (collective, after `begin_weight_update`)."""
        resend = getattr(self._weight_sender, "resend", None)
        if resend is not None:
            manifest: WeightManifest | None = resend()
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

    def receive_weights(self, manifest: WeightManifest, target: WeightTarget | None = None) -> SyncReport:
        """Apply `manifest` to `target` (default: the engine's own weights)."""
        return self._weight_receiver.receive(manifest, target if target is not None else self._weight_target)

    def weight_version(self) -> int:
        return self._weight_target.version
