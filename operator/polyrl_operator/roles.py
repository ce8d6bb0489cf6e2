"""The four roles of an RLJob and what sets them apart: one table of traits, and a job's role slots.

Every decision that depends on the kind of role (which pods restart the job, which the autoscaler
scales, which mount the model, the checkpoint or the data, which serve the Ray head, which entry
point the runtime runs) reads a trait of ``ROLE_TRAITS`` instead of spelling a set of role names,
so the planning, the builders and the checks cannot disagree on it. ``role_slots`` is the other half:
where each role's settings sit in a given job's spec (the one place that maps a role to its field).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal, get_args

from polyrl_operator.api import RLJob, RoleOverrides

Role = Literal["coordinator", "workflow", "rollout", "trainer"]
ROLES: Final[tuple[Role, ...]] = get_args(Role)
"""In the order the operator lists roles everywhere: the job's own roles, then each policy's."""

ModelMount = Literal["none", "read-only", "read-write"]
EntryPoint = Literal["coordinator", "worker"]


@dataclass(frozen=True)
class RoleTraits:
    """What the operator does differently for a role."""

    per_policy: bool
    """One set of pods per policy (``<job>-<policy>-<role>-<i>``), else one per job."""
    singleton: bool
    """Exactly one pod per job, named without an index and reached through a ClusterIP Service
    (no headless Service, no subdomain)."""
    elastic: bool
    """Replicas between the spec's min and max, decided by the autoscaler and recorded in status; a
    finished pod is replaced on its own; scale-in drains the highest index first. Kueue reserves
    the maximum."""
    restarts_job: bool
    """Its pods belong to a restart attempt (``polyrl.dev/attempt`` label, ``POLYRL_ATTEMPT``): a
    failed pod of the current attempt restarts the training roles from the last checkpoint,
    counted in ``status.restarts``."""
    entry_point: EntryPoint
    """The runtime command its container runs (``polyrl-runtime coordinator|worker``)."""
    gpus: bool
    """Its spec has ``gpus`` and ``gpuType`` (GPU requests, node placement, ``/dev/shm``)."""
    ray_head: bool
    """Runs the Ray head: exposes the GCS and client ports (and the dashboard when asked for)."""
    rendezvous: bool
    """Listens on the rank rendezvous port (data-parallel ranks of one policy)."""
    model_mount: ModelMount
    """How its pods mount their policy's model claim (``model.uri`` on a ``pvc://`` claim)."""
    mounts_checkpoint: bool
    """Mounts the checkpoint claim read-write (each writer saves its own part)."""
    mounts_data: bool
    """Mounts the prompt data's claims read-only (it reads ``spec.data`` and hands rows out)."""
    metrics_sinks: bool
    """Runs the metrics sinks: gets ``spec.metrics.credentialsSecret``'s keys as environment."""


ROLE_TRAITS: Final[Mapping[Role, RoleTraits]] = MappingProxyType(
    {
        "coordinator": RoleTraits(
            per_policy=False,
            singleton=True,
            elastic=False,
            restarts_job=True,
            entry_point="coordinator",
            gpus=False,
            ray_head=True,
            rendezvous=False,
            model_mount="none",
            mounts_checkpoint=True,
            mounts_data=True,
            metrics_sinks=True,
        ),
        "workflow": RoleTraits(
            per_policy=False,
            singleton=False,
            elastic=True,
            restarts_job=False,
            entry_point="worker",
            gpus=False,
            ray_head=False,
            rendezvous=False,
            model_mount="none",
            mounts_checkpoint=False,
            mounts_data=False,
            metrics_sinks=False,
        ),
        "rollout": RoleTraits(
            per_policy=True,
            singleton=False,
            elastic=True,
            restarts_job=False,
            entry_point="worker",
            gpus=True,
            ray_head=False,
            rendezvous=False,
            model_mount="read-only",
            mounts_checkpoint=False,
            mounts_data=False,
            metrics_sinks=False,
        ),
        "trainer": RoleTraits(
            per_policy=True,
            singleton=False,
            elastic=False,
            restarts_job=True,
            entry_point="worker",
            gpus=True,
            ray_head=False,
            rendezvous=True,
            model_mount="read-write",
            mounts_checkpoint=True,
            mounts_data=False,
            metrics_sinks=False,
        ),
    }
)
_BY_NAME: Final[Mapping[str, RoleTraits]] = {str(role): traits for role, traits in ROLE_TRAITS.items()}


def traits_of(role: str | None) -> RoleTraits | None:
    """The traits of a role read from a label (any string); None when it names no role."""
    return _BY_NAME.get(role) if role is not None else None


def restarts_job(role: str | None) -> bool:
    """Whether a pod with this role label belongs to a restart attempt (see ``RoleTraits``)."""
    traits = traits_of(role)
    return traits is not None and traits.restarts_job


@dataclass(frozen=True)
class RoleSlot:
    """One role of one job (a policy's rollout, the workflow, ...): its settings and pod counts."""

    role: Role
    policy: str | None
    path: str
    """Where its settings sit in the spec (``spec.coordinator``, ``spec.policies[0].rollout``)."""
    overrides: RoleOverrides
    gpus: int
    gpu_type: str | None
    min_replicas: int
    max_replicas: int
    """Equal to ``min_replicas`` unless the role is elastic."""

    @property
    def traits(self) -> RoleTraits:
        return ROLE_TRAITS[self.role]


def role_slots(job: RLJob) -> tuple[RoleSlot, ...]:
    """Every role slot of the job: the coordinator, the workflow, then each policy's rollout and
    trainer (the order of podSets, Services, status and events)."""
    spec = job.spec
    wf = spec.workflow.replicas
    slots = [
        RoleSlot("coordinator", None, "spec.coordinator", spec.coordinator, 0, None, 1, 1),
        RoleSlot("workflow", None, "spec.workflow", spec.workflow, 0, None, wf.min, wf.max),
    ]
    for i, p in enumerate(spec.policies):
        rollout, trainer, path = p.rollout, p.trainer, f"spec.policies[{i}]"
        slots += [
            RoleSlot(
                "rollout",
                p.name,
                f"{path}.rollout",
                rollout,
                rollout.gpus,
                rollout.gpu_type,
                rollout.replicas.min,
                rollout.replicas.max,
            ),
            RoleSlot(
                "trainer",
                p.name,
                f"{path}.trainer",
                trainer,
                trainer.gpus,
                trainer.gpu_type,
                trainer.replicas,
                trainer.replicas,
            ),
        ]
    return tuple(slots)


def role_slot(job: RLJob, role: Role, policy: str | None) -> RoleSlot:
    """The slot of ``role`` (of ``policy`` for a per-policy role; ignored for the others)."""
    owner = policy if ROLE_TRAITS[role].per_policy else None
    for slot in role_slots(job):
        if slot.role == role and slot.policy == owner:
            return slot
    raise KeyError(f"no policy {policy!r} in job {job.metadata.name}")
