"""The request-info resolution and RBAC rule matching the RBAC tests rely on (k8s.io/apiserver
RequestInfoFactory and the RBAC authorizer), on cases whose answers the Kubernetes docs fix."""

from __future__ import annotations

from typing import Any

import pytest

from polyrl_testenv.request_log import Authorizer, request_attributes


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        ("GET", "/api/v1/namespaces/ns/pods", "", ("list", "", "pods", "", "ns", "")),
        ("GET", "/api/v1/namespaces/ns/pods", "watch=true&labelSelector=a", ("watch", "", "pods", "", "ns", "")),
        ("GET", "/api/v1/watch/namespaces/ns/pods", "", ("watch", "", "pods", "", "ns", "")),
        ("GET", "/api/v1/pods", "watch=1", ("watch", "", "pods", "", "", "")),
        ("POST", "/api/v1/namespaces/ns/events", "", ("create", "", "events", "", "ns", "")),
        ("PATCH", "/apis/polyrl.dev/v1alpha1/namespaces/ns/rljobs/j/status", "", ("patch", "polyrl.dev", "rljobs", "status", "ns", "j")),
        ("DELETE", "/api/v1/namespaces/ns/pods/p", "", ("delete", "", "pods", "", "ns", "p")),
        ("DELETE", "/api/v1/namespaces/ns/pods", "", ("deletecollection", "", "pods", "", "ns", "")),
        ("PUT", "/apis/apps/v1/namespaces/ns/deployments/d/scale", "", ("update", "apps", "deployments", "scale", "ns", "d")),
        ("GET", "/apis/kueue.x-k8s.io/v1beta2/resourceflavors/f", "", ("get", "kueue.x-k8s.io", "resourceflavors", "", "", "f")),
        ("GET", "/api/v1/namespaces", "", ("list", "", "namespaces", "", "", "")),
        ("GET", "/api/v1/namespaces/ns", "", ("get", "", "namespaces", "", "ns", "ns")),
        ("PUT", "/api/v1/namespaces/ns/finalize", "", ("update", "", "namespaces", "finalize", "ns", "ns")),
    ],
)  # fmt: skip
def test_request_attributes(method: str, path: str, query: str, expected: tuple[str, ...]) -> None:
    a = request_attributes(method, path, query)
    assert a.resource_request
    assert (a.verb, a.api_group, a.resource, a.subresource, a.namespace, a.name) == expected


@pytest.mark.parametrize(
    "path", ["/api", "/api/v1", "/apis", "/apis/apps", "/apis/apps/v1", "/version", "/openapi/v3"]
)
def test_discovery_is_not_a_resource_request(path: str) -> None:
    a = request_attributes("GET", path)
    assert not a.resource_request and a.path == path


def _sa_binding(kind: str, role_kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"bind-{name}"}
    if namespace:
        meta["namespace"] = namespace
    return {
        "kind": kind,
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "sys"}],
    }


MANIFESTS: list[dict[str, Any]] = [
    {"kind": "ClusterRole", "metadata": {"name": "cluster"}, "rules": [
        {"apiGroups": ["polyrl.dev"], "resources": ["rljobs"], "verbs": ["list", "watch"]},
        {"apiGroups": ["polyrl.dev"], "resources": ["rljobs/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"], "resourceNames": ["settings"]},
    ]},
    _sa_binding("ClusterRoleBinding", "ClusterRole", "cluster"),
    {"kind": "Role", "metadata": {"name": "pods", "namespace": "team-a"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete"]},
    ]},
    _sa_binding("RoleBinding", "Role", "pods", "team-a"),
    # A Role bound to somebody else grants the operator nothing.
    {"kind": "Role", "metadata": {"name": "secrets", "namespace": "team-a"}, "rules": [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"]},
    ]},
    {**_sa_binding("RoleBinding", "Role", "secrets", "team-a"), "subjects": [{"kind": "ServiceAccount", "name": "other", "namespace": "sys"}]},
]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path", "query", "allowed"),
    [
        ("GET", "/apis/polyrl.dev/v1alpha1/rljobs", "watch=true", True),
        ("GET", "/apis/polyrl.dev/v1alpha1/namespaces/x/rljobs", "", True),
        ("GET", "/apis/polyrl.dev/v1alpha1/namespaces/x/rljobs/j", "", False),  # get is not list
        ("PATCH", "/apis/polyrl.dev/v1alpha1/namespaces/x/rljobs/j/status", "", True),
        ("PATCH", "/apis/polyrl.dev/v1alpha1/namespaces/x/rljobs/j", "", False),  # status only
        ("POST", "/api/v1/namespaces/team-a/pods", "", True),
        ("POST", "/api/v1/namespaces/team-b/pods", "", False),  # the Role is team-a's only
        ("DELETE", "/api/v1/namespaces/team-a/pods", "", False),  # deletecollection is not delete
        ("GET", "/api/v1/namespaces/team-a/secrets", "", False),  # bound to another subject
        ("GET", "/api/v1/namespaces/x/configmaps/settings", "", True),
        ("GET", "/api/v1/namespaces/x/configmaps/other", "", False),  # resourceNames
        ("GET", "/api/v1/namespaces/x/configmaps", "", False),  # a list never matches resourceNames
        ("GET", "/apis", "", True),  # system:discovery
        ("GET", "/metrics", "", False),
    ],
)  # fmt: skip
def test_authorizer(method: str, path: str, query: str, allowed: bool) -> None:
    authz = Authorizer(MANIFESTS, "sys", "op")
    assert (authz.allows(request_attributes(method, path, query)) is not None) == allowed


def test_granted_lists_the_bound_rules_only() -> None:
    granted = {grant for _, grant, _ in Authorizer(MANIFESTS, "sys", "op").granted()}
    assert ("", "secrets", "list") not in granted
    assert {("polyrl.dev", "rljobs", "list"), ("", "pods", "create"), ("", "configmaps", "get")} <= granted


def test_binding_to_a_missing_role_is_an_error() -> None:
    with pytest.raises(AssertionError, match="missing"):
        Authorizer([_sa_binding("ClusterRoleBinding", "ClusterRole", "nope")], "sys", "op")
