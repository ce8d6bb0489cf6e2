"""Services: the coordinator's ClusterIP Service and one headless Service per role (per policy for
a policy's roles, per pool for a pool's pods).

Headless Services give every pod of a role a stable DNS name ``<pod>.<service>.<ns>.svc`` (pods set
hostname/subdomain) for rank rendezvous, like KubeRay's headless worker service. They publish
not-ready addresses so pods can find each other before they pass readiness.
"""

from __future__ import annotations

from polyrl_operator import naming
from polyrl_operator import pod_contract as contract
from polyrl_operator.builders.common import JobRef, Manifest, metadata, stamp_hash
from polyrl_operator.roles import Role


def build_coordinator_service(ref: JobRef, *, dashboard: bool = False) -> Manifest:
    """The coordinator's ClusterIP Service; the Ray dashboard's port only when the head serves it
    (`spec.coordinator.dashboard`), so the Service never advertises a port nothing listens on."""
    ports = [
        {"name": "http", "port": contract.PORT_HTTP, "targetPort": contract.PORT_HTTP, "protocol": "TCP"},
        {
            "name": "gcs",
            "port": contract.PORT_RAY_GCS,
            "targetPort": contract.PORT_RAY_GCS,
            "protocol": "TCP",
        },
        {
            "name": "client",
            "port": contract.PORT_RAY_CLIENT,
            "targetPort": contract.PORT_RAY_CLIENT,
            "protocol": "TCP",
        },
    ]
    if dashboard:
        ports.append(
            {
                "name": "dashboard",
                "port": contract.PORT_RAY_DASHBOARD,
                "targetPort": contract.PORT_RAY_DASHBOARD,
                "protocol": "TCP",
            }
        )
    manifest: Manifest = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            ref, naming.coordinator_service(ref.name), naming.labels(ref.name, "coordinator")
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": naming.selector(ref.name, "coordinator"),
            "ports": ports,
        },
    }
    return stamp_hash(manifest)


def build_headless_service(ref: JobRef, role: Role, owner: str | None = None) -> Manifest:
    """The headless Service of a role's pods (``owner``: its policy, or its pool for a pool)."""
    name = naming.role_service(ref.name, role, owner)
    manifest: Manifest = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ref, name, naming.labels(ref.name, role, owner)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": naming.selector(ref.name, role, owner),
            "ports": [
                {
                    "name": "http",
                    "port": contract.PORT_HTTP,
                    "targetPort": contract.PORT_HTTP,
                    "protocol": "TCP",
                },
                {
                    "name": "rendezvous",
                    "port": contract.PORT_RENDEZVOUS,
                    "targetPort": contract.PORT_RENDEZVOUS,
                    "protocol": "TCP",
                },
            ],
        },
    }
    return stamp_hash(manifest)
