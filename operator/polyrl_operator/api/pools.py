"""Device pools: pods whose devices several roles (of one or several policies) share, and where each
role's pods and devices come from (`Placement`: its own pods, or a pool's)."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from polyrl_operator.api.common import DNS_LABEL_PATTERN, Replicas, RoleOverrides
from polyrl_operator.api.patterns import GPU_TYPE_PATTERN

MAX_POOLS = 16


class Pool(RoleOverrides):
    """A named set of pods whose devices the roles that name it share: a policy whose rollout and
    trainer name the same pool is colocated; several policies naming one pool share its devices."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=40,
        pattern=DNS_LABEL_PATTERN,
        description="Pool name, used in pod names (<job>-pool-<name>-<i>) and by the roles' pool field.",
    )
    replicas: Replicas = Field(
        default_factory=Replicas,
        description="Pool pods (elastic above min: only rollout engines run on pods past replicas.min).",
    )
    gpus: int = Field(1, ge=0, le=64, description="GPUs per pool pod (nvidia.com/gpu); 0: CPU only.")
    gpu_type: str | None = Field(
        None,
        max_length=63,
        pattern=GPU_TYPE_PATTERN,
        description="Admin-defined GPU type name (e.g. h100); mapped to node placement by the operator.",
    )


@dataclass(frozen=True)
class Placement:
    """Where one role's pods and devices come from, its spec and its pool's resolved together."""

    pool: str | None
    """The pool whose pods run the role, or None for pods of its own."""
    gpus: int
    """GPUs per pod (shared with the pool's other roles when pooled)."""
    gpu_type: str | None
    min_replicas: int
    max_replicas: int
    """Pods the role runs on: a rollout runs one engine per pod, a trainer `ranks_per_pod` ranks on each
    of `min_replicas` pods (equal to `max_replicas` for a dedicated trainer)."""
    ranks_per_pod: int = 1
    """Trainer ranks per pod (one per GPU, or ranksPerPod on CPU); 1 for a rollout."""

    @property
    def trainer_world(self) -> int:
        """Ranks of a trainer placed here: `ranks_per_pod` on each of `min_replicas` pods."""
        return self.min_replicas * self.ranks_per_pod


@dataclass(frozen=True)
class SharedBase:
    """Policies whose rollouts share one engine per pod of `pool`: the base model `model_uri` in
    `dtype`, resident once, with each trained policy's LoRA adapter on it; the `frozen` ones among
    `policies` are served the base alone (`RLJobSpec.shared_bases`)."""

    pool: str
    model_uri: str
    dtype: str
    policies: tuple[str, ...]
    frozen: tuple[str, ...] = ()
    """The members with `frozen: true`, in the order of `policies`: no adapter, no trainer, no
    weight sync (the base never changes: the trained members' updates move their adapters only)."""

    @property
    def trained(self) -> tuple[str, ...]:
        """The members served as LoRA adapters (never empty: a group has one at least)."""
        return tuple(n for n in self.policies if n not in self.frozen)
