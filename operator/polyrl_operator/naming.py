"""Names, labels and annotations of everything the operator creates for an RLJob.

One module so that the builders, the plan and the kopf index filters agree on every string (what
the pods themselves are given, ports and paths included, is ``polyrl_operator.pod_contract``).
Child names are stable and derived from the job (no generated suffixes): that is what makes apply
idempotent and a restarted operator converge.
"""

from __future__ import annotations

from typing import Final

from polyrl_operator.pod_contract import ANNOTATION_CHECKPOINT_REQUEST, ANNOTATION_DRAIN
from polyrl_operator.roles import ROLE_TRAITS, Role

DOMAIN: Final = "polyrl.dev"
LABEL_JOB: Final = f"{DOMAIN}/job"
LABEL_POLICY: Final = f"{DOMAIN}/policy"
LABEL_POOL: Final = f"{DOMAIN}/pool"
"""On a pool's pods (role ``pool``), in place of the policy: the pool's name."""
LABEL_ROLE: Final = f"{DOMAIN}/role"
LABEL_INDEX: Final = f"{DOMAIN}/index"
LABEL_ATTEMPT: Final = f"{DOMAIN}/attempt"
"""Coordinator and trainer pods (and pool pods hosting a trainer) carry the restart attempt they
belong to (status.restarts when created); a failure of a pod of an older attempt was already
counted. A trainer pod replaced alone is created again with the same attempt."""
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_KUEUE_QUEUE: Final = "kueue.x-k8s.io/queue-name"
"""Kueue's label naming a job's LocalQueue; read when ``spec.scheduling.queueName`` is unset."""
MANAGER: Final = "polyrl-operator"

ANNOTATION_HASH: Final = f"{DOMAIN}/spec-hash"
"""Hash of the manifest the operator wants; a different hash on the live object means drift."""
ANNOTATION_DRAIN_SINCE: Final = f"{DOMAIN}/drain-since"
"""RFC 3339 time the drain was requested, so the drain timeout survives an operator restart."""
ANNOTATION_CHECKPOINT_SINCE: Final = f"{DOMAIN}/checkpoint-since"
"""RFC 3339 time the checkpoint request (pod_contract.ANNOTATION_CHECKPOINT_REQUEST) was made."""
ANNOTATION_SERVES: Final = f"{DOMAIN}/serves"
# On a pool pod: the policies its engine serves as LoRA adapters on one base ("a,b" per base, "; " between).
ANNOTATION_SHARED_BASES: Final = f"{DOMAIN}/shared-bases"
"""On a pool pod: the roles it hosts, ``policy/role`` comma-separated in spec order (e.g.
``solver/rollout,solver/trainer``), for people and tools reading the pod."""
MUTABLE_ANNOTATIONS: Final = (
    ANNOTATION_DRAIN,
    ANNOTATION_DRAIN_SINCE,
    ANNOTATION_CHECKPOINT_REQUEST,
    ANNOTATION_CHECKPOINT_SINCE,
)
"""Annotations the operator patches on live pods (the two requests of the pod contract and when
each was made); not part of the pod's identity (hash)."""

FINALIZER: Final = f"{DOMAIN}/cleanup"
CONTAINER: Final = "main"
TOKEN_KEY: Final = "ray-token"

MAX_NAME: Final = 63


def coordinator_pod(job: str) -> str:
    return f"{job}-coordinator"


def coordinator_service(job: str) -> str:
    return f"{job}-coordinator"


def workflow_pod(job: str, index: int) -> str:
    return f"{job}-workflow-{index}"


def workflow_service(job: str) -> str:
    return f"{job}-workflow"


def policy_pod(job: str, policy: str, role: Role, index: int) -> str:
    return f"{job}-{policy}-{role}-{index}"


def policy_service(job: str, policy: str, role: Role) -> str:
    return f"{job}-{policy}-{role}"


def pool_pod(job: str, pool: str, index: int) -> str:
    return f"{job}-pool-{pool}-{index}"


def pool_service(job: str, pool: str) -> str:
    return f"{job}-pool-{pool}"


def role_pod(job: str, role: Role, owner: str | None, index: int) -> str:
    """The pod of any role: a singleton's has no index, a per-policy role's names its policy and a
    pool's its pool (``owner``; ignored for the roles that belong to the whole job)."""
    traits = ROLE_TRAITS[role]
    if traits.singleton:
        return f"{job}-{role}"
    if traits.per_pool:
        return pool_pod(job, owner or "", index)
    return policy_pod(job, owner or "", role, index) if traits.per_policy else f"{job}-{role}-{index}"


def role_service(job: str, role: Role, owner: str | None) -> str:
    """The Service of any role (the singleton's ClusterIP one, the others' headless ones)."""
    traits = ROLE_TRAITS[role]
    if traits.per_pool:
        return pool_service(job, owner or "")
    return policy_service(job, owner or "", role) if traits.per_policy else f"{job}-{role}"


def config_map(job: str) -> str:
    return f"{job}-config"


def secret(job: str) -> str:
    return f"{job}-ray-token"


def service_account(job: str) -> str:
    """The job's own ServiceAccount: its pods run as it; it is bound to no role (no API access)."""
    return f"{job}-runtime"


def network_policy(job: str) -> str:
    """NetworkPolicy selecting every pod of the job: ingress only from pods of the same job."""
    return f"{job}-isolation"


def progress_network_policy(job: str) -> str:
    """NetworkPolicy selecting the coordinator: ingress on the HTTP port from the operator."""
    return f"{job}-progress"


def workload(job: str) -> str:
    return job


def podset(role: Role, owner: str | None) -> str:
    """Kueue podSet name of a role (a DNS label, unique in the Workload): ``<policy>-<role>`` of a
    per-policy role, ``<pool>-pool`` of a pool (no policy's role is named ``pool``, so the two never
    meet), the role of the others."""
    return f"{owner}-{role}" if owner else role


def coordinator_host(job: str, namespace: str) -> str:
    return f"{coordinator_service(job)}.{namespace}.svc"


def _owner_label(role: Role) -> str:
    return LABEL_POOL if ROLE_TRAITS[role].per_pool else LABEL_POLICY


def labels(job: str, role: Role | None = None, owner: str | None = None) -> dict[str, str]:
    """Labels every child carries: the job (for the index and cleanup), the role, and its policy
    (``polyrl.dev/policy``) or, for a pool, its pool (``polyrl.dev/pool``)."""
    out = {LABEL_JOB: job, LABEL_MANAGED_BY: MANAGER}
    if role is not None:
        out[LABEL_ROLE] = role
        if owner is not None:
            out[_owner_label(role)] = owner
    return out


def selector(job: str, role: Role, owner: str | None = None) -> dict[str, str]:
    """The Service selector of a role: the same keys as ``labels`` minus the manager."""
    out = {LABEL_JOB: job, LABEL_ROLE: role}
    if owner is not None:
        out[_owner_label(role)] = owner
    return out


def longest_child_name(
    job: str, policies: list[str], workflow_max: int, pools: list[str] | None = None
) -> tuple[str, int]:
    """The longest child name and its length (for the operator's own length check)."""
    names = [
        coordinator_pod(job),
        config_map(job),
        secret(job),
        service_account(job),
        network_policy(job),
        progress_network_policy(job),
        workflow_pod(job, max(workflow_max - 1, 0)),
    ]
    names.extend(policy_service(job, p, r) for p in policies for r, t in ROLE_TRAITS.items() if t.per_policy)
    names.extend(pool_service(job, q) for q in pools or ())
    longest = max(names, key=len)
    return longest, len(longest)
