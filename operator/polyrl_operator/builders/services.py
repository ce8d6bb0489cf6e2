"""Services: the coordinator's ClusterIP Service and one headless Service per role.

Headless Services give every pod of a role a stable DNS name ``<pod>.<service>.<ns>.svc`` (pods set
hostname/subdomain) for rank rendezvous, like KubeRay's headless worker service. They publish
not-ready addresses so pods can find each other before they pass readiness.
"""

from __future__ import annotations

from polyrl_operator import naming
from polyrl_operator.builders.common import JobRef, Manifest, metadata, stamp_hash
from polyrl_operator.naming import Role


def build_coordinator_service(ref: JobRef, *, dashboard: bool = False) -> Manifest:
    """The coordinator's ClusterIP Service; the Ray dashboard's port only when the head serves it
    (`spec.coordinator.dashboard`), so the Service never advertises a port nothing listens on."""
    ports = [
        {"name": "http", "port": naming.PORT_HTTP, "targetPort": naming.PORT_HTTP, "protocol": "TCP"},
        {"name": "gcs", "port": naming.PORT_RAY_GCS, "targetPort": naming.PORT_RAY_GCS, "protocol": "TCP"},
        {
            "name": "client",
            "port": naming.PORT_RAY_CLIENT,
            "targetPort": naming.PORT_RAY_CLIENT,
            "protocol": "TCP",
        },
    ]
    if dashboard:
        ports.append(
            {
                "name": "dashboard",
                "port": naming.PORT_RAY_DASHBOARD,
                "targetPort": naming.PORT_RAY_DASHBOARD,
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


def build_headless_service(ref: JobRef, role: Role, policy: str | None = None) -> Manifest:
    name = naming.policy_service(ref.name, policy, role) if policy else naming.workflow_service(ref.name)
    manifest: Manifest = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ref, name, naming.labels(ref.name, role, policy)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": naming.selector(ref.name, role, policy),
            "ports": [
                {"name": "http", "port": naming.PORT_HTTP, "targetPort": naming.PORT_HTTP, "protocol": "TCP"},
                {
                    "name": "rendezvous",
                    "port": naming.PORT_RENDEZVOUS,
                    "targetPort": naming.PORT_RENDEZVOUS,
                    "protocol": "TCP",
                },
            ],
        },
    }
    return stamp_hash(manifest)
