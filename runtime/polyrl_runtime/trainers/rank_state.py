"""A trainer rank's state beyond its step, a mixin of `DeepSpeedTrainer`: the weights it publishes
to its engines, its checkpoints and export, and its offload to host memory on a device pool (while
offloaded, every call that needs its tensors fails with `TrainerOffloadedError`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog
import torch

from polyrl_operator.api import Policy
from polyrl_operator.api.algorithm import Algorithm
from polyrl_runtime import storage
from polyrl_runtime.device_memory import HostBuffers, ParkedMemory
from polyrl_runtime.models import is_hf, model_dir
from polyrl_runtime.trainers.api import OffloadReport
from polyrl_runtime.trainers.critic import Critic
from polyrl_runtime.trainers.export import export_policy, zero_gather
from polyrl_runtime.trainers.offload import TrainerOffloadedError, offload_rank, restore_rank
from polyrl_runtime.trainers.publish import published_tensors
from polyrl_runtime.weights.endpoints import TrainerWeights

log = structlog.get_logger(__name__)


class RankState(TrainerWeights):
    """What `DeepSpeedTrainer.__init__` and `setup` set, which these methods read."""

    name: str
    spec: Policy
    algo: Algorithm
    rank: int
    version: int
    device: torch.device
    model: Any
    ref: Any
    engine: Any
    critic: Critic | None
    adapter_only: bool
    adapter_name: str | None
    _offloaded: ParkedMemory | None
    _host_buffers: HostBuffers

    # -- weights and checkpoints ------------------------------------------------------------------

    def init_sender(self, transport: str, bucket_bytes: int, transport_kwargs: Mapping[str, object]) -> None:
        self.init_weight_sender(transport, self.spec.name, bucket_bytes, **transport_kwargs)

    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        """What the engines load: parameters only, tied once, Hugging Face names (adapters merged under
        LoRA; the adapter alone when the engines share the base), gathered bucket by bucket under
        ZeRO-3 (`publish.published_tensors`)."""
        self._require_resident("publishing weights")
        module = self.engine.module if self.engine is not None else self.model
        return published_tensors(
            module,
            zero_gather(self.spec.trainer.zero_stage),
            adapter_only=self.adapter_only,
            adapter=self.adapter_name,
        )

    def gather_for_peers(self) -> None:
        """ZeRO-3, ranks > 0: take part in the bucket gathers rank 0 does to publish weights."""
        self._require_resident("publishing weights")
        module = self.engine.module if self.engine is not None else self.model
        published_tensors(
            module,
            zero_gather(self.spec.trainer.zero_stage),
            keep=False,
            adapter_only=self.adapter_only,
            adapter=self.adapter_name,
        )

    def save(self, directory: str, tag: str) -> None:
        """`directory`: a local path or an object-store URI (each rank stages and uploads its files)."""
        self._require_resident("saving a checkpoint")
        # LoRA: the frozen base is the model URI's, so only adapters and optimizer state are stored.
        with storage.staged_dir(directory) as local:
            self.engine.save_checkpoint(
                str(local),
                tag=tag,
                client_state={"version": self.version},
                exclude_frozen_parameters=self.algo.lora is not None,
            )
            if self.critic is not None:
                self.critic.save(local, tag)

    def load(self, directory: str, tag: str) -> None:
        self._require_resident("loading a checkpoint")
        self.begin_weight_update()
        with storage.fetched_dir(directory) as local:
            _, client = self.engine.load_checkpoint(
                str(local), tag=tag, load_module_strict=self.algo.lora is None
            )
            if self.critic is not None:
                self.critic.load(local, tag)
        self.version = int((client or {}).get("version", self.version))

    def export(self, directory: str) -> None:
        """Write the policy as a Hugging Face model directory (trainers/export.py). Every rank calls
        it at once (ZeRO-3 gathers are collective); rank 0 writes."""
        self._require_resident("exporting")
        uri = self.spec.model.uri
        with storage.staged_dir(directory) as local:
            export_policy(
                self.engine.module,
                local,
                source_dir=model_dir(uri) if is_hf(uri) else None,
                source_uri=uri,
                gather=zero_gather(self.spec.trainer.zero_stage),
                writer=self.rank == 0,
            )

    # -- device pools ----------------------------------------------------------------------------

    def offload(self) -> OffloadReport:
        """Move this rank's state to host memory (trainers/offload.py); `restore` brings it back."""
        if self.engine is None:
            raise RuntimeError(f"trainer rank {self.name}: nothing to offload before setup")
        if self._offloaded is not None:
            raise RuntimeError(f"trainer rank {self.name}: offloaded already")
        self.begin_weight_update()  # a sender reading these tensors finishes first
        critic = self.critic.engine if self.critic is not None else None
        self._offloaded = parked = offload_rank(
            self.engine, self.ref, self.device, self._host_buffers, critic
        )
        log.info("trainer.offloaded", rank=self.name, bytes=parked.nbytes, seconds=parked.seconds)
        return OffloadReport(self.rank, "offload", parked.seconds, parked.host_bytes)

    def restore(self) -> OffloadReport:
        if self._offloaded is None:
            raise RuntimeError(f"trainer rank {self.name}: not offloaded, nothing to restore")
        parked = self._offloaded
        seconds = restore_rank(parked, self.name)  # on failure it stays offloaded: restore may be retried
        self._offloaded = None
        log.info("trainer.restored", rank=self.name, bytes=parked.nbytes, seconds=seconds)
        return OffloadReport(self.rank, "restore", seconds, parked.nbytes)

    def _require_resident(self, what: str) -> None:
        if self._offloaded is not None:
            raise TrainerOffloadedError(self.name, what)
