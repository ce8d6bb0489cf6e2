"""The roles of an RLJob and what sets them apart: one table of traits, and a job's role slots.

Every decision that depends on the kind of role (which pods restart the job, which the autoscaler
scales, which mount the model, the checkpoint or the data, which serve the Ray head, which entry
point the runtime runs) reads a trait of ``ROLE_TRAITS`` instead of spelling a set of role names,
so the planning, the builders and the checks cannot disagree on it. ``role_slots`` is the other half:
where each role's settings sit in a given job's spec (the one place that maps a role to its field).

Device pools (``spec.pools``) add the role ``pool``: the pods of one pool, which host the rollouts
and trainers placed on it (their ``pool`` field). A pooled rollout or trainer has no pods and so no
slot of its own; its pool's slot lists it (``RoleSlot.placed``). What a pool pod needs besides the
pool's own traits depends on what it hosts: ``RoleSlot.traits_at(index)`` adds the traits of every
role that pod hosts (``hosting``), so a pool pod hosting a trainer restarts the job, listens on the
rendezvous port and mounts the checkpoint like a trainer pod, and one hosting only rollout engines
is replaced alone like a rollout pod. A failed trainer pod of its own is replaced alone (the runtime
restarts that policy's trainer by itself); a failed pool pod hosting a trainer still restarts the
job, since the pool's other roles and turns go with it (``replaced_alone_on_failure`` is not hosted).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Final, Literal, get_args

from polyrl_operator.api import Placement, RLJob, RoleOverrides

Role = Literal["coordinator", "workflow", "rollout", "trainer", "pool"]
ROLES: Final[tuple[Role, ...]] = get_args(Role)
"""In the order the operator lists roles everywhere: the job's own roles, each policy's, the pools."""
PolicyRole = Literal["rollout", "trainer"]
"""The roles every policy has, each on pods of its own or on a pool's."""

ModelMount = Literal["none", "read-only", "read-write"]
MODEL_MOUNTS: Final[tuple[ModelMount, ...]] = get_args(ModelMount)
"""From the weakest to the strongest: a pod hosting several roles mounts a claim the strongest way."""
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
    finished pod is replaced on its own (unless it restarts the job); scale-in drains the highest
    index first. Kueue reserves the maximum."""
    restarts_job: bool
    """Its pods belong to a restart attempt (``polyrl.dev/attempt`` label, ``POLYRL_ATTEMPT``): a
    restart of the job (a new attempt) recreates them. A failed pod of the current attempt restarts
    the training roles from the last checkpoint, counted in ``status.restarts``, unless the role is
    ``replaced_alone_on_failure``."""
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
    per_pool: bool = False
    """One set of pods per device pool (``<job>-pool-<pool>-<i>``): the pods of the roles placed
    on that pool."""
    replaced_alone_on_failure: bool = False
    """A failed pod of the current attempt is replaced on its own instead of restarting the job:
    deleted now (a ``Replacing`` event), created again next round with the same attempt label. The
    runtime restarts the ranks it hosted by themselves, from their policy's latest checkpoint,
    counted per policy against ``failurePolicy.maxRestarts``. Only a role's own pods: ``hosting``
    never passes it on, so a pool pod hosting such a role restarts the job."""


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
            replaced_alone_on_failure=True,
        ),
        # A pool's own traits are those of a pod that hosts nothing; ``hosting`` adds, per pod,
        # the traits of the roles placed on it that the pod runs (RoleSlot.traits_at).
        "pool": RoleTraits(
            per_policy=False,
            per_pool=True,
            singleton=False,
            elastic=True,
            restarts_job=False,
            entry_point="worker",
            gpus=True,
            ray_head=False,
            rendezvous=False,
            model_mount="none",
            mounts_checkpoint=False,
            mounts_data=False,
            metrics_sinks=False,
        ),
    }
)
_BY_NAME: Final[Mapping[str, RoleTraits]] = {str(role): traits for role, traits in ROLE_TRAITS.items()}


def traits_of(role: str | None) -> RoleTraits | None:
    """The traits of a role read from a label (any string); None when it names no role."""
    return _BY_NAME.get(role) if role is not None else None


def hosting(traits: RoleTraits, roles: Iterable[Role]) -> RoleTraits:
    """``traits`` (a pool's) plus what each of ``roles`` (those a pod of the pool hosts) needs: the
    restart attempt, the rendezvous port, the checkpoint and data claims and the metrics secret when
    any of them needs it, the model claim the strongest way any of them mounts it. Never
    ``replaced_alone_on_failure`` from what it hosts: the runtime restarts a trainer alone only on
    pods of its own, so a failed pool pod hosting one restarts the job."""
    hosted = [ROLE_TRAITS[role] for role in roles]
    return replace(
        traits,
        restarts_job=traits.restarts_job or any(t.restarts_job for t in hosted),
        rendezvous=traits.rendezvous or any(t.rendezvous for t in hosted),
        mounts_checkpoint=traits.mounts_checkpoint or any(t.mounts_checkpoint for t in hosted),
        mounts_data=traits.mounts_data or any(t.mounts_data for t in hosted),
        metrics_sinks=traits.metrics_sinks or any(t.metrics_sinks for t in hosted),
        model_mount=max((traits.model_mount, *(t.model_mount for t in hosted)), key=MODEL_MOUNTS.index),
    )


@dataclass(frozen=True)
class PlacedRole:
    """A policy's rollout or trainer placed on a pool."""

    policy: str
    role: PolicyRole

    def __str__(self) -> str:
        """``solver/rollout``: how status and the pods' annotation name it."""
        return f"{self.policy}/{self.role}"


@dataclass(frozen=True)
class RoleSlot:
    """One role of one job (a policy's rollout, the workflow, a pool, ...): its settings and pod
    counts. A pooled rollout or trainer has no slot: its pool's slot lists it in ``placed``."""

    role: Role
    policy: str | None
    path: str
    """Where its settings sit in the spec (``spec.coordinator``, ``spec.policies[0].rollout``,
    ``spec.pools[0]``)."""
    overrides: RoleOverrides
    gpus: int
    gpu_type: str | None
    min_replicas: int
    max_replicas: int
    """Equal to ``min_replicas`` unless the role is elastic."""
    pool: str | None = None
    """The pool's name (role ``pool`` only)."""
    placed: tuple[PlacedRole, ...] = ()
    """The rollouts and trainers placed on the pool, in spec order (role ``pool`` only)."""

    @property
    def owner(self) -> str | None:
        """Whose pods these are: the policy of a per-policy role, the pool of a pool, else None."""
        return self.pool if self.traits.per_pool else self.policy if self.traits.per_policy else None

    @property
    def traits(self) -> RoleTraits:
        """The role's own traits, shared by all its pods. A pool pod's traits also depend on what
        it hosts: read those that do (restart attempt, ports, mounts) from ``traits_at``."""
        return ROLE_TRAITS[self.role]

    def hosted(self, index: int) -> tuple[PlacedRole, ...]:
        """What pod ``index`` of a pool runs: one engine of every rollout placed on the pool on
        each pod, a placed trainer's ranks on the first ``min_replicas`` pods only. So the pods
        past the minimum, the only ones the autoscaler adds and drains, host rollout engines alone:
        scale-in never takes a trainer's pod. Empty for other roles."""
        return tuple(r for r in self.placed if r.role == "rollout" or index < self.min_replicas)

    def traits_at(self, index: int) -> RoleTraits:
        """The traits of pod ``index``: the role's own, plus those of the roles it hosts (a pool's)."""
        return hosting(self.traits, (r.role for r in self.hosted(index))) if self.placed else self.traits


def role_slots(job: RLJob) -> tuple[RoleSlot, ...]:
    """Every role slot of the job: the coordinator, the workflow, each policy's rollout and trainer
    that run on pods of their own (a frozen policy has no trainer), then each pool (the order of
    podSets, Services, status and events).

    A pool's replicas range is its spec's, except that a pool with no rollout placed on it stays at
    ``replicas.min``: only rollout engines run past the minimum, so further pods would hold devices
    for nothing."""
    spec = job.spec
    wf = spec.workflow.replicas
    slots = [
        RoleSlot("coordinator", None, "spec.coordinator", spec.coordinator, 0, None, 1, 1),
        RoleSlot("workflow", None, "spec.workflow", spec.workflow, 0, None, wf.min, wf.max),
    ]
    placed: dict[str, list[PlacedRole]] = {}
    for i, p in enumerate(spec.policies):
        roles: tuple[tuple[PolicyRole, RoleOverrides, Placement], ...] = (
            ("rollout", p.rollout, spec.rollout_placement(p)),
        ) + ((("trainer", p.trainer, spec.trainer_placement(p)),) if not p.frozen else ())
        for role, overrides, placement in roles:
            if placement.pool is not None:
                placed.setdefault(placement.pool, []).append(PlacedRole(p.name, role))
                continue
            slots.append(
                RoleSlot(
                    role,
                    p.name,
                    f"spec.policies[{i}].{role}",
                    overrides,
                    placement.gpus,
                    placement.gpu_type,
                    placement.min_replicas,
                    placement.max_replicas,
                )
            )
    for i, q in enumerate(spec.pools or ()):
        on_pool = tuple(placed.get(q.name, ()))
        most = q.replicas.max if any(r.role == "rollout" for r in on_pool) else q.replicas.min
        slots.append(
            RoleSlot(
                "pool",
                None,
                f"spec.pools[{i}]",
                q,
                q.gpus,
                q.gpu_type,
                q.replicas.min,
                most,
                pool=q.name,
                placed=on_pool,
            )
        )
    return tuple(slots)


def role_slot(job: RLJob, role: Role, owner: str | None) -> RoleSlot:
    """The slot of ``role``: of the policy ``owner`` names for a per-policy role, of the pool it
    names for a pool; ``owner`` is ignored for the roles that belong to the whole job. KeyError when
    the job has no such slot (no such policy or pool, or a policy's role placed on a pool)."""
    traits = ROLE_TRAITS[role]
    wanted = owner if traits.per_policy or traits.per_pool else None
    for slot in role_slots(job):
        if slot.role == role and slot.owner == wanted:
            return slot
    name = job.metadata.name
    if traits.per_pool:
        raise KeyError(f"no pool {owner!r} in job {name}")
    policy = next((p for p in job.spec.policies if p.name == owner), None)
    if policy is None:
        raise KeyError(f"no policy {owner!r} in job {name}")
    raise KeyError(f"the {role} of policy {owner!r} in job {name} runs on a pool, not on pods of its own")


def pod_traits(job: RLJob, role: str | None, owner: str | None, index: int) -> RoleTraits | None:
    """The traits of a job's pod read from its labels (role, policy or pool, index): a pool pod's
    from what it hosts (``RoleSlot.traits_at``), any other's its role's. None when the role label
    names no role, or names a pool the spec no longer has (its pods go; nothing they did counts)."""
    traits = traits_of(role)
    if traits is None or not traits.per_pool:
        return traits
    slot = next((s for s in role_slots(job) if s.role == role and s.owner == owner), None)
    return slot.traits_at(index) if slot is not None else None
