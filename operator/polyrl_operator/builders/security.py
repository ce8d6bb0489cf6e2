"""What isolates a job: its own ServiceAccount (bound to nothing) and its NetworkPolicies, plus the
security context every job pod runs with.

* ServiceAccount ``<job>-runtime``: pods run as it with no token mounted; no Role or RoleBinding
  names it, so job pods have no Kubernetes API access at all (the operator alone writes status).
* NetworkPolicy ``<job>-isolation`` (every pod of the job): ingress only from pods of the same job
  (Ray, NCCL/gloo, rendezvous, weight sync all stay inside the job), plus the admin's extra rules.
* NetworkPolicy ``<job>-progress`` (the coordinator only): ingress on the HTTP port (``/progress``,
  ``/healthz``) from the operator's pods. NetworkPolicies add up, so this opens exactly that port
  of exactly that pod to the operator and nothing else.
* Security context: the restricted Pod Security Standard (non-root UID, no privilege escalation,
  every capability dropped, the runtime's default seccomp profile) and a read-only root filesystem
  where the role allows (settings), with a writable ``emptyDir`` at /tmp for scratch and caches.
"""

from __future__ import annotations

from typing import Any

from polyrl_operator import naming
from polyrl_operator.builders.common import JobRef, Manifest, metadata, stamp_hash
from polyrl_operator.pod_contract import PORT_HTTP
from polyrl_operator.roles import Role
from polyrl_operator.settings import OperatorSettings

NETWORKING_API_VERSION = "networking.k8s.io/v1"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Set by the API server on every namespace (immutable): selects the operator's namespace."""


def build_service_account(ref: JobRef) -> Manifest:
    manifest: Manifest = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(ref, naming.service_account(ref.name), naming.labels(ref.name)),
        "automountServiceAccountToken": False,
    }
    return stamp_hash(manifest)


def build_network_policies(ref: JobRef, settings: OperatorSettings) -> list[Manifest]:
    """The job's two NetworkPolicies (none when the admin turned them off)."""
    np = settings.network_policy
    if not np.enabled:
        return []
    job_pods = {"matchLabels": {naming.LABEL_JOB: ref.name}}
    same_job: list[dict[str, Any]] = [{"from": [{"podSelector": job_pods}]}]
    isolation: Manifest = {
        "apiVersion": NETWORKING_API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": metadata(ref, naming.network_policy(ref.name), naming.labels(ref.name)),
        "spec": {
            "podSelector": job_pods,
            "policyTypes": ["Ingress"],
            "ingress": same_job + [dict(rule) for rule in np.extra_ingress],
        },
    }
    progress: Manifest = {
        "apiVersion": NETWORKING_API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": metadata(
            ref, naming.progress_network_policy(ref.name), naming.labels(ref.name, "coordinator")
        ),
        "spec": {
            "podSelector": {"matchLabels": naming.selector(ref.name, "coordinator")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: np.namespace()}},
                            "podSelector": {"matchLabels": dict(np.operator_pod_labels)},
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": PORT_HTTP}],
                }
            ],
        },
    }
    return [stamp_hash(isolation), stamp_hash(progress)]


def pod_security_context(settings: OperatorSettings) -> dict[str, Any]:
    sec = settings.pod_security
    return {
        "runAsNonRoot": True,
        "runAsUser": sec.run_as_user,
        "runAsGroup": sec.run_as_group,
        "fsGroup": sec.fs_group,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(role: Role, settings: OperatorSettings) -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": settings.pod_security.read_only_root_filesystem.get(role, False),
        "capabilities": {"drop": ["ALL"]},
    }
