"""Snapshots of past versions in the torch engine (a league's opponents), a mixin of `TorchEngine`.

An engine of LoRA adapters holds a policy's past versions as frozen copies of its adapter
(`engines/adapters.py`): `snapshot` takes one between two forward passes, and a request names it by
`SamplingParams.snapshot`. A version evicted to make room fails its requests still in the engine
with `UnknownSnapshotError` at once (their cache rows would be served other weights); they leave the
queues and the batch before the next step, and are not counted as aborted by their callers.

A full-weight engine holds its policy's snapshots in host memory and serves them through copies of
the model, each an engine of its own over a copy (`engines/full_snapshots.py`); `snapshot_slots`
(`league.residentSnapshots`) bounds the copies.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
import torch

from polyrl_runtime.engines.adapters import EngineAdapters
from polyrl_runtime.engines.api import Generation, SamplingParams, SnapshotReport, UnknownSnapshotError
from polyrl_runtime.engines.full_snapshots import FullSnapshots, SlotEngine
from polyrl_runtime.engines.torch_request import TorchRequest
from polyrl_runtime.weights.api import TensorTarget

log = structlog.get_logger(__name__)

NOT_OWN_POLICY = "engine {engine} serves policy {own}'s full weights: it holds no snapshots of {policy}"


class TorchEngineSnapshots:
    """`snapshot` over the engine's state, which `TorchEngine.__init__` sets."""

    name: str
    policy: str
    model_uri: str
    model: torch.nn.Module
    device: torch.device
    max_batch: int
    adapters: EngineAdapters | None
    target: TensorTarget
    snapshot_slots: int
    full_snapshots: FullSnapshots | None
    _by_id: dict[str, TorchRequest]
    _pending: list[TorchRequest]
    _active: list[TorchRequest]
    _held: list[TorchRequest]

    def _ensure_loop(self) -> asyncio.Event:
        raise NotImplementedError  # the engine's serving loop

    async def snapshot(self, policy: str, keep: int) -> SnapshotReport:
        """Hold `policy`'s current version as a snapshot, at most `keep` of them (the oldest evicted)."""
        if self.adapters is None:
            full = self._full(policy)
            version = self.target.version
            if version not in full.host:  # copied off the event loop, between two forward passes
                version, tensors = await asyncio.to_thread(full.copy_of, self.target)
                return self._held_now(full.hold(version, tensors, keep))
            return self._held_now(full.hold(version, {}, keep))
        adapters = self.adapters
        with self.target.lock:  # between two forward passes (a step in a thread holds it)
            report = adapters.snapshot(policy, keep)
        return self._held_now(report)

    async def snapshot_state(
        self, policy: str, versions: Sequence[int]
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Copies of `policy`'s snapshots at `versions`, for an engine that joined to hold them."""
        if self.adapters is None:
            return self._full(policy).tensors(versions)
        adapters = self.adapters
        with self.target.lock:
            return adapters.snapshot_tensors(policy, versions)

    async def load_snapshots(
        self, policy: str, states: Mapping[int, Mapping[str, torch.Tensor]], keep: int
    ) -> SnapshotReport:
        """Hold snapshots copied from another engine of the policy (`snapshot_state`), at most `keep`."""
        if self.adapters is None:
            return self._held_now(self._full(policy).receive(states, keep))
        adapters = self.adapters
        with self.target.lock:
            report = adapters.receive_snapshots(policy, states, keep)
        return self._held_now(report)

    def _full(self, policy: str) -> FullSnapshots:
        """The full-weight snapshots of the engine's policy (made at the first call)."""
        if policy not in ("", self.policy):
            raise ValueError(NOT_OWN_POLICY.format(engine=self.name, own=self.policy, policy=policy))
        if self.full_snapshots is None:
            self.full_snapshots = FullSnapshots(
                self.name, self.policy, self.snapshot_slots, self._serving_copy
            )
        return self.full_snapshots

    def _serving_copy(self, i: int) -> SlotEngine:
        """An engine of its own over a copy of the model, to serve snapshots (`FullSnapshots`)."""
        with self.target.lock:  # no update swaps a tensor while it is copied
            model = copy.deepcopy(self.model)
        engine_class: Any = type(self)  # the TorchEngine this mixin is part of
        engine: SlotEngine = engine_class(
            f"{self.name}#snapshot{i}",
            self.policy,
            self.model_uri,
            model=model,
            device=str(self.device),
            max_batch=self.max_batch,
        )
        return engine

    async def _snapshot_generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """A request for a past version of a full-weight engine's policy."""
        if params.snapshot is None or params.policy not in ("", self.policy):
            raise ValueError(f"engine {self.name} serves policy {self.policy}, not {params.policy}")
        if self.full_snapshots is None:
            raise UnknownSnapshotError(self.name, self.policy, params.snapshot, ())
        return await self.full_snapshots.generate(prompt_ids, params)

    def serves(self, request_id: str) -> bool:
        """Whether a request of that id is in the engine (for an engine's serving copies' aborts)."""
        return request_id in self._by_id

    def load(self) -> tuple[int, int]:
        """Requests (in flight, queued), a serving copy's included."""
        full = self.full_snapshots.load() if self.full_snapshots is not None else (0, 0)
        queued = len(self._pending) + len(self._held)
        return queued + len(self._active) + full[0], queued + full[1]

    def _snapshots_held(self) -> dict[str, list[int]]:
        """Per policy with snapshots, the versions held (`EngineStats.snapshots`)."""
        if self.adapters is not None:
            return self.adapters.snapshots()
        full = self.full_snapshots
        return {self.policy: full.held()} if full is not None and full.host else {}

    def _snapshot_figures(self) -> dict[str, float | int]:
        """A full-weight engine's snapshot memory and switches (`EngineStats.extra`)."""
        return self.full_snapshots.figures() if self.full_snapshots is not None else {}

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
