"""Unit tests of the shim's pure parts (no control plane needed)."""

from __future__ import annotations

from typing import Any

from polyrl_testenv.corekinds import map_core_path, to_public, version_priority
from polyrl_testenv.strategicpatch import apply_strategic_merge_patch


def test_strategic_merge_patch_merges_lists_by_key() -> None:
    original: dict[str, Any] = {
        "metadata": {"labels": {"a": "1", "b": "2"}, "finalizers": ["x"]},
        "spec": {
            "containers": [
                {"name": "main", "image": "v1", "env": [{"name": "A", "value": "1"}]},
                {"name": "side", "image": "s"},
            ],
            "tolerations": [{"key": "k"}],
        },
    }
    patch = {
        "metadata": {"labels": {"b": None, "c": "3"}, "finalizers": ["y"]},
        "spec": {
            "$setElementOrder/containers": [{"name": "main"}, {"name": "side"}],
            "containers": [
                {"name": "main", "env": [{"name": "B", "value": "2"}]},
                {"name": "side", "$patch": "delete"},
            ],
            "tolerations": [{"key": "other"}],
        },
    }
    result = apply_strategic_merge_patch(original, patch)
    assert result["metadata"] == {"labels": {"a": "1", "c": "3"}, "finalizers": ["x", "y"]}
    assert result["spec"]["containers"] == [
        {"name": "main", "image": "v1", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}
    ]
    assert result["spec"]["tolerations"] == [{"key": "other"}]  # no merge key: replaced
    assert original["metadata"]["labels"] == {"a": "1", "b": "2"}  # input untouched


def test_strategic_merge_patch_directives() -> None:
    original = {"spec": {"strategy": {"type": "X", "rolling": {"a": 1}}, "finalizers": ["a", "b"]}}
    patch = {
        "spec": {
            "strategy": {"$retainKeys": ["type"], "type": "Y"},
            "$deleteFromPrimitiveList/finalizers": ["a"],
        }
    }
    assert apply_strategic_merge_patch(original, patch) == {
        "spec": {"strategy": {"type": "Y"}, "finalizers": ["b"]}
    }
    replaced = apply_strategic_merge_patch({"m": {"a": 1}}, {"m": {"$patch": "replace", "b": 2}})
    assert replaced == {"m": {"b": 2}}


def test_core_paths() -> None:
    pod = map_core_path("namespaces/ns/pods/p/status")
    assert (pod.internal, pod.resource, pod.name, pod.subresource) == (
        "/apis/core.shim.polyrl.dev/v1/namespaces/ns/pods/p/status",
        "pods",
        "p",
        "status",
    )
    ns = map_core_path("namespaces/ns")  # the Namespace object, not a namespace scope
    assert (ns.internal, ns.resource, ns.name) == (
        "/apis/core.shim.polyrl.dev/v1/shimnamespaces/ns",
        "namespaces",
        "ns",
    )
    watch = map_core_path("watch/namespaces")
    assert watch.legacy_watch and watch.internal == "/apis/core.shim.polyrl.dev/v1/shimnamespaces"


def test_to_public_rewrites_lists_events_and_status() -> None:
    event: dict[str, Any] = {
        "type": "ADDED",
        "object": {"apiVersion": "core.shim.polyrl.dev/v1", "kind": "Pod"},
    }
    assert to_public(event)["object"]["apiVersion"] == "v1"
    listed = to_public(
        {"apiVersion": "core.shim.polyrl.dev/v1", "kind": "PodList", "items": [dict(event["object"])]}
    )
    assert (listed["apiVersion"], listed["items"][0]["apiVersion"]) == ("v1", "v1")
    status = {
        "kind": "Status",
        "apiVersion": "v1",
        "message": 'shimnamespaces.core.shim.polyrl.dev "x" not found',
    }
    assert to_public(status)["message"] == 'namespaces "x" not found'


def test_version_priority() -> None:
    versions = ["v1alpha1", "v2", "foo", "v1beta2", "v1", "v1beta1"]
    assert sorted(versions, key=version_priority) == ["v2", "v1", "v1beta2", "v1beta1", "v1alpha1", "foo"]


def test_group_paths_and_bodies() -> None:
    from polyrl_testenv.corekinds import map_group_path, to_internal

    deploy = map_group_path("/apis/apps/v1/namespaces/ns/deployments/d/status")
    assert deploy is not None
    assert (deploy.internal, deploy.resource, deploy.name, deploy.subresource) == (
        "/apis/apps.shim.polyrl.dev/v1/namespaces/ns/deployments/d/status",
        "deployments",
        "d",
        "status",
    )
    role = map_group_path("/apis/rbac.authorization.k8s.io/v1/clusterroles/r")
    assert (
        role is not None
        and role.internal == "/apis/rbac.authorization.k8s.io.shim.polyrl.dev/v1/clusterroles/r"
    )
    watch = map_group_path("/apis/networking.k8s.io/v1/watch/namespaces/ns/networkpolicies")
    assert watch is not None and watch.legacy_watch and watch.resource == "networkpolicies"
    assert map_group_path("/apis/polyrl.dev/v1alpha1/rljobs") is None  # a real CRD: not mapped
    body = to_internal({"apiVersion": "apps/v1", "kind": "Deployment"})
    assert body["apiVersion"] == "apps.shim.polyrl.dev/v1"
    assert to_internal({"apiVersion": "apps/v1", "kind": "Widget"})["apiVersion"] == "apps/v1"
    public = to_public({"apiVersion": "networking.k8s.io.shim.polyrl.dev/v1", "kind": "NetworkPolicyList", "items": [
        {"apiVersion": "networking.k8s.io.shim.polyrl.dev/v1", "kind": "NetworkPolicy"}]})  # fmt: skip
    assert public["apiVersion"] == public["items"][0]["apiVersion"] == "networking.k8s.io/v1"
    discovery = to_public(
        {"kind": "APIResourceList", "groupVersion": "apps.shim.polyrl.dev/v1", "resources": []}
    )
    assert discovery["groupVersion"] == "apps/v1"
    status = to_public({"kind": "Status", "message": 'deployments.apps.shim.polyrl.dev "d" not found',
                        "details": {"group": "apps.shim.polyrl.dev"}})  # fmt: skip
    assert status["message"] == 'deployments.apps "d" not found' and status["details"]["group"] == "apps"
