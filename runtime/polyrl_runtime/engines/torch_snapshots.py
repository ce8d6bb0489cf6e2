"""Snapshots of past versions in the torch engine (a league's opponents), a mixin of `TorchEngine`.

An engine of LoRA adapters holds a policy's past versions as frozen copies of its adapter
(`engines/adapters.py`): `snapshot` takes one between two forward passes, and a request names it by
`SamplingParams.snapshot`. A version evicted to make room fails its requests still in the engine
with `UnknownSnapshotError` at once (their cache rows would be served other weights); they leave the
queues and the batch before the next step, and are not counted as aborted by their callers.

A full-weight engine holds no snapshots: it serves one set of weights, and a past version of them
would be a second copy of the model in the engine's memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import structlog
import torch

from polyrl_runtime.engines.adapters import EngineAdapters
from polyrl_runtime.engines.api import SnapshotReport, UnknownSnapshotError
from polyrl_runtime.engines.torch_request import TorchRequest
from polyrl_runtime.weights.api import TensorTarget

log = structlog.get_logger(__name__)

NO_FULL_WEIGHT_SNAPSHOTS = (
    "engine {engine} serves policy {policy}'s full weights: past versions are served as snapshots "
    "of a LoRA adapter only (algorithm.lora)"
)


class TorchEngineSnapshots:
    """`snapshot` over the engine's state, which `TorchEngine.__init__` sets."""

    name: str
    policy: str
    adapters: EngineAdapters | None
    target: TensorTarget
    _pending: list[TorchRequest]
    _active: list[TorchRequest]
    _held: list[TorchRequest]

    def _ensure_loop(self) -> asyncio.Event:
        raise NotImplementedError  # the engine's serving loop

    async def snapshot(self, policy: str, keep: int) -> SnapshotReport:
        """Hold `policy`'s current version as a snapshot, at most `keep` of them (the oldest evicted)."""
        if self.adapters is None:
            raise ValueError(NO_FULL_WEIGHT_SNAPSHOTS.format(engine=self.name, policy=policy))
        adapters = self.adapters
        with self.target.lock:  # between two forward passes (a step in a thread holds it)
            report = adapters.snapshot(policy, keep)
        return self._held_now(report)

    async def snapshot_state(
        self, policy: str, versions: Sequence[int]
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Copies of `policy`'s snapshots at `versions`, for an engine that joined to hold them."""
        if self.adapters is None:
            raise ValueError(NO_FULL_WEIGHT_SNAPSHOTS.format(engine=self.name, policy=policy))
        adapters = self.adapters
        with self.target.lock:
            return adapters.snapshot_tensors(policy, versions)

    async def load_snapshots(
        self, policy: str, states: Mapping[int, Mapping[str, torch.Tensor]], keep: int
    ) -> SnapshotReport:
        """Hold snapshots copied from another engine of the policy (`snapshot_state`), at most `keep`."""
        if self.adapters is None:
            raise ValueError(NO_FULL_WEIGHT_SNAPSHOTS.format(engine=self.name, policy=policy))
        adapters = self.adapters
        with self.target.lock:
            report = adapters.receive_snapshots(policy, states, keep)
        return self._held_now(report)

    def _held_now(self, report: SnapshotReport) -> SnapshotReport:
        """`report`'s evictions applied to the requests in the engine, and logged."""
        policy = report.policy
        if report.evicted:
            gone = set(report.evicted)
            for r in (*self._pending, *self._held, *self._active):
                p = r.params
                if p.policy == policy and p.snapshot in gone and not r.future.done():
                    r.future.set_exception(UnknownSnapshotError(self.name, policy, p.snapshot, report.held))
                    r.counted = True  # evicted, not aborted by its caller
            self._ensure_loop().set()
        log.info(
            "engine.snapshot",
            engine=self.name,
            policy=policy,
            version=report.version,
            evicted=list(report.evicted),
            held=list(report.held),
            nbytes=report.nbytes,
        )
        return report
