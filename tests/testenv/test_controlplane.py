"""Tests of the control-plane harness itself: the real CRD server behind the shim must look like a
Kubernetes API server to kubectl, the kubernetes Python client and raw HTTP (as kopf uses it)."""

from __future__ import annotations

import http.client
import json
import textwrap
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from polyrl_testenv import ControlPlane

pytestmark = pytest.mark.controlplane

WIDGET_CRD = textwrap.dedent(
    """
    apiVersion: apiextensions.k8s.io/v1
    kind: CustomResourceDefinition
    metadata: {name: widgets.test.polyrl.dev}
    spec:
      group: test.polyrl.dev
      scope: Namespaced
      names: {plural: widgets, singular: widget, kind: Widget, shortNames: [wdg]}
      versions:
      - name: v1
        served: true
        storage: true
        subresources: {status: {}}
        schema:
          openAPIV3Schema:
            type: object
            properties:
              spec:
                type: object
                description: Desired widget.
                x-kubernetes-validations:
                - rule: self.replicas <= self.maxReplicas
                  message: replicas must not exceed maxReplicas
                properties:
                  replicas: {type: integer, default: 1, description: How many.}
                  maxReplicas: {type: integer, default: 3}
                  mode: {type: string, enum: [fast, slow]}
              status:
                type: object
                properties:
                  phase: {type: string}
    """
)


def widget(name: str, **spec: Any) -> str:
    return json.dumps(
        {"apiVersion": "test.polyrl.dev/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}
    )


def pod(name: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "main", "image": "busybox", "env": [{"name": "A", "value": "1"}]}]},
    }


@pytest.fixture(scope="module")
def widgets(controlplane: ControlPlane) -> str:
    controlplane.kubectl("apply", "-f", "-", input=WIDGET_CRD, check=True)
    controlplane.kubectl("wait", "--for=condition=Established", "crd/widgets.test.polyrl.dev", check=True)
    return "widgets.test.polyrl.dev"


@pytest.fixture
def api(controlplane: ControlPlane) -> Iterator[Any]:
    with controlplane.api_client() as api_client:
        yield api_client


def test_discovery_for_kubectl(controlplane: ControlPlane, widgets: str) -> None:
    out = controlplane.kubectl("api-resources", check=True).stdout
    for line in ("pods ", "namespaces ", "configmaps ", "events ", "customresourcedefinitions ", "widgets "):
        assert line in out
    assert "shim.polyrl.dev" not in out  # the internal group stays hidden
    status, groups = controlplane.request("GET", "/apis")
    assert status == 200
    assert {"apiextensions.k8s.io", "test.polyrl.dev"} <= {g["name"] for g in groups["groups"]}
    status, versions = controlplane.request("GET", "/api")
    assert (status, versions["versions"]) == (200, ["v1"])
    version = controlplane.kubectl("version", "-o", "json", check=True).stdout
    assert json.loads(version)["serverVersion"]["minor"] == "36"


def test_pod_with_kubectl(controlplane: ControlPlane, namespace: str) -> None:
    manifest = json.dumps(pod("p1", app="x"))
    controlplane.kubectl("apply", "-n", namespace, "-f", "-", input=manifest, check=True)
    got = controlplane.kubectl_json("get", "pod", "p1", "-n", namespace)
    assert (got["apiVersion"], got["kind"], got["metadata"]["labels"]) == ("v1", "Pod", {"app": "x"})
    listed = controlplane.kubectl_json("get", "pods", "-n", namespace, "-l", "app=x")
    assert listed["kind"] == "List"
    assert [p["metadata"]["name"] for p in listed["items"]] == ["p1"]
    assert "p1" in controlplane.kubectl("get", "pods", "-n", namespace, check=True).stdout  # table output
    # kubectl apply of a changed built-in kind sends a strategic merge patch (the shim emulates it).
    changed = pod("p1", app="x")
    changed["spec"]["containers"][0]["env"] = [{"name": "B", "value": "2"}]
    controlplane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(changed), check=True)
    got = controlplane.kubectl_json("get", "pod", "p1", "-n", namespace)
    assert got["spec"]["containers"][0]["env"] == [{"name": "B", "value": "2"}]
    controlplane.kubectl(
        "patch", "pod", "p1", "-n", namespace, "-p", '{"metadata":{"labels":{"b":"2"}}}', check=True
    )
    controlplane.kubectl(
        "apply", "--server-side", "--force-conflicts", "-n", namespace, "-f", "-", input=manifest, check=True
    )
    got = controlplane.kubectl_json("get", "pod", "p1", "-n", namespace)
    assert got["metadata"]["labels"] == {"app": "x", "b": "2"}
    controlplane.kubectl("delete", "pod", "p1", "-n", namespace, "--wait=true", check=True)
    assert "NotFound" in controlplane.kubectl("get", "pod", "p1", "-n", namespace).stderr


def test_kubectl_typed_commands_send_protobuf(controlplane: ControlPlane, namespace: str) -> None:
    # kubectl create <generator> / run use client-go typed clients, which send protobuf bodies.
    ns = ["-n", namespace]
    for args in (
        ["create", "configmap", "cm1", "--from-literal=a=b"],
        ["create", "secret", "generic", "s1", "--from-literal=pw=hunter2"],
        ["create", "serviceaccount", "sa1"],
        ["create", "service", "clusterip", "svc1", "--tcp=80:8080"],
        [
            "run",
            "r1",
            "--image=busybox",
            "--restart=Never",
            "--env=A=1",
            "--labels=app=r",
            "--",
            "sleep",
            "1",
        ],
    ):
        controlplane.kubectl(*ns, *args, check=True)
    assert controlplane.kubectl_json("get", "cm", "cm1", *ns)["data"] == {"a": "b"}
    assert controlplane.kubectl_json("get", "secret", "s1", *ns)["data"] == {"pw": "aHVudGVyMg=="}
    ports = controlplane.kubectl_json("get", "svc", "svc1", *ns)["spec"]["ports"]
    assert ports == [{"name": "80-8080", "port": 80, "protocol": "TCP", "targetPort": 8080}]
    spec = controlplane.kubectl_json("get", "pod", "r1", *ns)["spec"]
    assert spec["containers"][0]["args"] == ["sleep", "1"]
    assert spec["containers"][0]["env"] == [{"name": "A", "value": "1"}]
    assert spec["restartPolicy"] == "Never"
    controlplane.kubectl("create", "namespace", f"{namespace}-x", check=True)
    controlplane.kubectl("delete", "namespace", f"{namespace}-x", check=True)


def test_pod_with_python_client(api: Any, namespace: str) -> None:
    core: Any = client.CoreV1Api(api)  # plain dicts as bodies, as tests use them
    created = core.create_namespaced_pod(namespace, pod("p2", app="y"))
    assert created.metadata.resource_version
    assert [p.metadata.name for p in core.list_namespaced_pod(namespace, label_selector="app=y").items] == [
        "p2"
    ]
    core.patch_namespaced_pod(
        "p2",
        namespace,
        {"metadata": {"labels": {"extra": "1"}}},
        _content_type="application/merge-patch+json",
    )
    # status subresource: the main resource ignores status, /status sets it
    core.patch_namespaced_pod(
        "p2", namespace, {"status": {"phase": "Bogus"}}, _content_type="application/merge-patch+json"
    )
    status = core.read_namespaced_pod("p2", namespace).status
    assert status is None or status.phase is None
    core.patch_namespaced_pod_status(
        "p2", namespace, {"status": {"phase": "Running"}}, _content_type="application/merge-patch+json"
    )
    got = core.read_namespaced_pod("p2", namespace)
    assert (got.status.phase, got.metadata.labels) == ("Running", {"app": "y", "extra": "1"})
    # optimistic concurrency: a stale resourceVersion is a 409
    stale = created.to_dict()
    stale["metadata"] = {"name": "p2", "resourceVersion": created.metadata.resource_version}
    with pytest.raises(ApiException) as conflict:
        core.replace_namespaced_pod("p2", namespace, stale)
    assert conflict.value.status == 409
    core.delete_namespaced_pod("p2", namespace)
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_pod("p2", namespace)
    assert missing.value.status == 404


def test_create_without_content_type(controlplane: ControlPlane, namespace: str) -> None:
    url = urlsplit(controlplane.server)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    body = json.dumps(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}}
    )
    try:
        conn.request("POST", f"/api/v1/namespaces/{namespace}/configmaps", body=body)  # no Content-Type
        resp = conn.getresponse()
        assert resp.status == 201, resp.read()
        assert json.loads(resp.read())["apiVersion"] == "v1"
    finally:
        conn.close()


def test_put_without_resource_version_replaces_a_builtin_object(
    controlplane: ControlPlane, namespace: str
) -> None:
    """As on a real API server (helm records its releases so); the CRD behind the shim would refuse it."""
    path = f"/api/v1/namespaces/{namespace}/secrets"
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "r", "labels": {"status": "pending"}}}
    code, created = controlplane.request("POST", path, body)
    assert code == 201, created
    body["metadata"]["labels"] = {"status": "deployed"}
    code, replaced = controlplane.request("PUT", f"{path}/r", body)
    assert code == 200, replaced
    assert replaced["metadata"]["labels"] == {"status": "deployed"}
    assert replaced["metadata"]["resourceVersion"] != created["metadata"]["resourceVersion"]
    stale = {
        **body,
        "metadata": {**body["metadata"], "resourceVersion": created["metadata"]["resourceVersion"]},
    }
    assert controlplane.request("PUT", f"{path}/r", stale)[0] == 409  # a stated precondition still holds


def test_secret_string_data_and_field_selectors(api: Any, namespace: str) -> None:
    core: Any = client.CoreV1Api(api)  # plain dicts as bodies, as tests use them
    core.create_namespaced_secret(namespace, {"metadata": {"name": "s"}, "stringData": {"token": "abc"}})
    assert core.read_namespaced_secret("s", namespace).data == {"token": "YWJj"}
    for name, node in (("a", "n1"), ("b", "n2")):
        body = pod(name)
        body["spec"]["nodeName"] = node
        core.create_namespaced_pod(namespace, body)
    on_n2 = core.list_namespaced_pod(namespace, field_selector="spec.nodeName=n2").items
    assert [p.metadata.name for p in on_n2] == ["b"]


class WatchStream:
    """A raw watch (as kopf does it): one JSON event per line, read as soon as it is sent."""

    def __init__(self, server: str, path: str) -> None:
        url = urlsplit(server)
        self.conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
        self.conn.request("GET", path)
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200

    def next(self) -> dict[str, Any]:
        line = self.resp.readline()
        assert line, "watch ended"
        return dict(json.loads(line))

    def close(self) -> None:
        self.conn.close()


def test_watch_streams_and_resumes(api: Any, controlplane: ControlPlane, namespace: str) -> None:
    core: Any = client.CoreV1Api(api)  # plain dicts as bodies, as tests use them
    start_rv = core.list_namespaced_config_map(namespace).metadata.resource_version
    base = f"/api/v1/namespaces/{namespace}/configmaps?watch=true&allowWatchBookmarks=true"
    stream = WatchStream(controlplane.server, f"{base}&resourceVersion={start_rv}")
    try:
        core.create_namespaced_config_map(namespace, {"metadata": {"name": "w1"}})
        event = stream.next()  # arrives while the watch is open: the shim does not buffer
        assert (event["type"], event["object"]["apiVersion"], event["object"]["metadata"]["name"]) == (
            "ADDED",
            "v1",
            "w1",
        )
        resume_rv = event["object"]["metadata"]["resourceVersion"]
    finally:
        stream.close()
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "w2"}})
    resumed = WatchStream(controlplane.server, f"{base}&resourceVersion={resume_rv}")
    try:
        event = resumed.next()
        assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "w2")
    finally:
        resumed.close()
    expired = WatchStream(controlplane.server, f"{base}&resourceVersion=1")
    try:
        event = expired.next()
        assert (event["type"], event["object"]["kind"], event["object"]["code"]) == ("ERROR", "Status", 410)
    finally:
        expired.close()


def test_watch_through_python_client(api: Any, namespace: str) -> None:
    from kubernetes import watch

    watcher: Any = watch.Watch()  # type: ignore[no-untyped-call]

    core: Any = client.CoreV1Api(api)  # plain dicts as bodies, as tests use them
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "pw"}})
    events = watcher.stream(core.list_namespaced_config_map, namespace, timeout_seconds=5)
    first = next(events)
    assert (first["type"], first["object"].metadata.name) == ("ADDED", "pw")


def test_crd_semantics_through_kubectl(controlplane: ControlPlane, namespace: str, widgets: str) -> None:
    ok = controlplane.kubectl("apply", "-n", namespace, "-f", "-", input=widget("w1", replicas=2))
    assert ok.returncode == 0, ok.stderr
    got = controlplane.kubectl_json("get", "widget", "w1", "-n", namespace)
    assert got["spec"] == {"replicas": 2, "maxReplicas": 3}  # defaulting
    bad = controlplane.kubectl("apply", "-n", namespace, "-f", "-", input=widget("w2", replicas=5))
    assert bad.returncode != 0
    assert "spec" in bad.stderr and "replicas must not exceed maxReplicas" in bad.stderr  # CEL rule
    unknown = controlplane.kubectl("apply", "-n", namespace, "-f", "-", input=widget("w3", bogus=1))
    assert unknown.returncode != 0
    assert 'unknown field "spec.bogus"' in unknown.stderr  # strict field validation is server-side
    enum = controlplane.kubectl("apply", "-n", namespace, "-f", "-", input=widget("w4", mode="medium"))
    assert enum.returncode != 0 and "spec.mode" in enum.stderr
    pruned = controlplane.kubectl(
        "create", "--validate=false", "-n", namespace, "-f", "-", input=widget("w5", bogus=1)
    )
    assert pruned.returncode == 0, pruned.stderr
    assert "bogus" not in controlplane.kubectl_json("get", "widget", "w5", "-n", namespace)["spec"]  # pruning
    ssa = controlplane.kubectl(
        "apply", "--server-side", "-n", namespace, "-f", "-", input=widget("w1", replicas=3)
    )
    assert ssa.returncode == 0, ssa.stderr
    patch = '{"status":{"phase":"Ready"}}'
    controlplane.kubectl(
        "patch",
        "widget",
        "w1",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        patch,
        check=True,
    )
    controlplane.kubectl(
        "wait",
        "widget/w1",
        "-n",
        namespace,
        "--for=jsonpath={.status.phase}=Ready",
        "--timeout=10s",
        check=True,
    )
    explain = controlplane.kubectl("explain", "widgets.spec", check=True).stdout
    assert "replicas" in explain and "How many." in explain
    controlplane.kubectl("delete", "widget", "w1", "-n", namespace, check=True)


def test_namespaces(controlplane: ControlPlane, api: Any, namespace: str) -> None:
    core: Any = client.CoreV1Api(api)
    names = [ns.metadata.name for ns in core.list_namespace().items]
    assert "default" in names and namespace in names
    got = controlplane.kubectl_json("get", "namespace", namespace)
    assert (got["kind"], got["apiVersion"], got["status"]["phase"]) == ("Namespace", "v1", "Active")
    assert namespace in controlplane.kubectl("get", "ns", check=True).stdout
    missing = controlplane.kubectl("get", "ns", "does-not-exist")
    assert 'namespaces "does-not-exist" not found' in missing.stderr


def test_events_and_finalizers(api: Any, namespace: str) -> None:
    core: Any = client.CoreV1Api(api)  # plain dicts as bodies, as tests use them
    event = {
        "metadata": {"generateName": "e-"},
        "involvedObject": {"kind": "Pod", "name": "x", "namespace": namespace},
        "reason": "Test",
        "message": "hello",
        "type": "Normal",
    }
    core.create_namespaced_event(namespace, event)
    assert [e.message for e in core.list_namespaced_event(namespace, field_selector="reason=Test").items] == [
        "hello"
    ]
    cm = {"metadata": {"name": "fin", "finalizers": ["test.polyrl.dev/hold"]}}
    core.create_namespaced_config_map(namespace, cm)
    core.delete_namespaced_config_map("fin", namespace)
    held = core.read_namespaced_config_map("fin", namespace)
    assert held.metadata.deletion_timestamp is not None
    core.patch_namespaced_config_map(
        "fin", namespace, {"metadata": {"finalizers": None}}, _content_type="application/merge-patch+json"
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            core.read_namespaced_config_map("fin", namespace)
        except ApiException as exc:
            assert exc.status == 404
            return
        time.sleep(0.05)
    pytest.fail("configmap not deleted after its finalizer was removed")


def test_readyz(controlplane: ControlPlane) -> None:
    # The CRD server alone never reports ready (it has no core APIs); the shim answers for it.
    url = urlsplit(controlplane.server)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    try:
        conn.request("GET", "/readyz")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
