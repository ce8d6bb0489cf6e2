"""A rollout engine actor's client: one method per remote method the job calls, each returning the
call's `ObjectRef` (see polyrl_runtime/actors.py). The driver holds one per engine (fleet, weight
sync, stats); the routing tables it sends to the workflow workers are these clients, which the
workers' `EnginePool` calls."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import ray

from polyrl_runtime.actors import ActorClient, call, stream
from polyrl_runtime.engines.api import (
    Engine,
    EngineStats,
    Generation,
    SamplingParams,
    SleepReport,
    SnapshotReport,
    WakeReport,
)
from polyrl_runtime.engines.batching import Answer, Request

if TYPE_CHECKING:  # weights.api imports torch, which a workflow worker (it imports this) never loads
    from polyrl_runtime.weights.api import SyncReport, WeightManifest


class EngineClient(ActorClient[Engine]):
    """Calls to one engine actor (`Engine` documents each method)."""

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> ray.ObjectRef[Generation]:
        return call(self.handle, Engine.generate, prompt_ids, params)

    def abort(self, request_ids: list[str]) -> ray.ObjectRef[None]:
        return call(self.handle, Engine.abort, request_ids)

    @property
    def streams(self) -> bool:
        """Whether the engine has `generate_many` (else the pool sends one `generate` per request)."""
        return getattr(self.handle, "generate_many", None) is not None

    def generate_many(self, requests: list[Request]) -> AsyncIterator[ray.ObjectRef[list[Answer]]]:
        """Every request in one call; each streamed item holds the answers finished since the last."""
        return stream(self.handle, Engine.generate_many, requests)

    def receive_weights(
        self, manifest: WeightManifest | ray.ObjectRef[WeightManifest]
    ) -> ray.ObjectRef[SyncReport]:
        """A published version, or the reference of a publish still running: Ray starts the call once
        the manifest exists and passes the engine the manifest itself."""
        return call(self.handle, Engine.receive_weights, cast("WeightManifest", manifest))

    def weight_version(self) -> ray.ObjectRef[int]:
        return call(self.handle, Engine.weight_version)

    def stats(self) -> ray.ObjectRef[EngineStats]:
        return call(self.handle, Engine.stats)

    def snapshot(self, policy: str, keep: int) -> ray.ObjectRef[SnapshotReport]:
        return call(self.handle, Engine.snapshot, policy, keep)

    def snapshot_state(
        self, policy: str, versions: Sequence[int]
    ) -> ray.ObjectRef[dict[int, dict[str, Any]]]:
        return call(self.handle, Engine.snapshot_state, policy, versions)

    def load_snapshots(
        self, policy: str, states: Mapping[int, Mapping[str, Any]], keep: int
    ) -> ray.ObjectRef[SnapshotReport]:
        return call(self.handle, Engine.load_snapshots, policy, states, keep)

    def sleep(self, level: int = 1) -> ray.ObjectRef[SleepReport]:
        return call(self.handle, Engine.sleep, level)

    def wake_up(self) -> ray.ObjectRef[WakeReport]:
        return call(self.handle, Engine.wake_up)
