"""A trainer rank actor's client: one method per remote method of `TrainerRank` (trainers/api.py), each
returning the call's `ObjectRef` (see polyrl_runtime/actors.py). Rank 0's client is also the weight
sync's `WeightSource` (weights/endpoints.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import ray

from polyrl_runtime.actors import ActorClient, call
from polyrl_runtime.trainers.api import OffloadReport, StepResult, TrainerRank

if TYPE_CHECKING:
    from polyrl_runtime.weights.api import WeightManifest


class TrainerRankClient(ActorClient[TrainerRank]):
    """Calls to one trainer rank (`TrainerRank` documents each method)."""

    def address(self) -> ray.ObjectRef[tuple[str, int]]:
        return call(self.handle, TrainerRank.address)

    def node_id(self) -> ray.ObjectRef[str]:
        return call(self.handle, TrainerRank.node_id)

    def setup(self, master_addr: str, master_port: int, local_rank: int) -> ray.ObjectRef[None]:
        return call(self.handle, TrainerRank.setup, master_addr, master_port, local_rank)

    def train_step(
        self, step: int, share: int, n_micro: int, global_std: float | None, version: int | None = None
    ) -> ray.ObjectRef[StepResult]:
        return call(self.handle, TrainerRank.train_step, step, share, n_micro, global_std, version)

    def gather_for_peers(self) -> ray.ObjectRef[None]:
        return call(self.handle, TrainerRank.gather_for_peers)

    def save(self, directory: str, tag: str) -> ray.ObjectRef[None]:
        return call(self.handle, TrainerRank.save, directory, tag)

    def load(self, directory: str, tag: str) -> ray.ObjectRef[None]:
        return call(self.handle, TrainerRank.load, directory, tag)

    def export(self, directory: str) -> ray.ObjectRef[None]:
        return call(self.handle, TrainerRank.export, directory)

    def offload(self) -> ray.ObjectRef[OffloadReport]:
        return call(self.handle, TrainerRank.offload)

    def restore(self) -> ray.ObjectRef[OffloadReport]:
        return call(self.handle, TrainerRank.restore)

    def init_sender(
        self, transport: str, bucket_bytes: int, transport_kwargs: Mapping[str, object]
    ) -> ray.ObjectRef[None]:
        return call(self.handle, TrainerRank.init_sender, transport, bucket_bytes, transport_kwargs)

    def publish_weights(self, version: int) -> ray.ObjectRef[WeightManifest]:
        return call(self.handle, TrainerRank.publish_weights, version)

    def resend_weights(self) -> ray.ObjectRef[WeightManifest | None]:
        return call(self.handle, TrainerRank.resend_weights)

    def set_weight_receivers(self, n: int) -> ray.ObjectRef[None]:
        return call(self.handle, TrainerRank.set_weight_receivers, n)

    def wait_weights(self) -> ray.ObjectRef[None]:
        return call(self.handle, TrainerRank.wait_weights)

    def abort_weights(self) -> ray.ObjectRef[None]:
        return call(self.handle, TrainerRank.abort_weights)
