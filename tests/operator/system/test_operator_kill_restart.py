"""Kill the operator process (SIGKILL) at random points while it reconciles several jobs, at least
20 times, with the cluster changing meanwhile; then restart it once more and check the exact child set:
every expected object exists once, with the content the operator would render, and nothing else."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator import naming
from polyrl_operator.planning import render
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv.bad_rljobs import CPU_EXAMPLE, REPO
from polyrl_testenv.operator_fixtures import pod_status
from polyrl_testenv.operator_proc import SyncApi, kill, start_operator

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

SETTINGS: dict[str, Any] = {
    "resyncSeconds": 1,
    "errorBackoff": 0.2,
    "errorBackoffMax": 1,
    "progressTimeout": 0.5,
}
CHILD_KINDS = {
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "Service": "/api/v1/namespaces/{ns}/services",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
}
KILLS = 22


def job(name: str, namespace: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(CPU_EXAMPLE.read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"]["failurePolicy"] = {"maxRestarts": 1000}
    return doc


@pytest.fixture(scope="module")
def crd(controlplane: Any) -> Any:
    result = controlplane.kubectl(
        "apply", "--server-side", "-f", str(REPO / "crds" / "polyrl.dev_rljobs.yaml")
    )
    assert result.returncode == 0, result.stderr
    controlplane.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/rljobs.polyrl.dev")
    return controlplane


def test_kill_and_restart_at_random_points_converges_exactly(
    crd: Any, namespace: str, tmp_path: Path
) -> None:
    api = SyncApi(crd.server)
    rljobs = f"/apis/polyrl.dev/v1alpha1/namespaces/{namespace}/rljobs"
    pods = f"/api/v1/namespaces/{namespace}/pods"
    rng = random.Random(20260101)

    def apply(doc: dict[str, Any]) -> None:
        result = crd.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
        assert result.returncode == 0, result.stderr

    def kubelet(fail_one: bool) -> None:
        items = api.list(pods)
        for pod in items:
            if not pod.get("status") and not pod["metadata"].get("deletionTimestamp"):
                api.merge(f"{pods}/{pod['metadata']['name']}/status", {"status": pod_status()})
        # A failed trainer pod is replaced alone; a failed coordinator restarts its job.
        roles = ("trainer", "coordinator")
        victims = [p for p in items if p["metadata"]["labels"].get(naming.LABEL_ROLE) in roles]
        if fail_one and victims:
            victim = rng.choice(victims)["metadata"]["name"]
            api.merge(f"{pods}/{victim}/status", {"status": pod_status("Failed")})

    for name in ("alpha", "bravo", "charlie", "delta"):
        apply(job(name, namespace))

    kills = 0
    for i in range(KILLS):
        proc = start_operator(crd.kubeconfig, namespace, SETTINGS, tmp_path, str(i))
        # Startup (imports, listing, indexing) and reconciling all happen in this window; the kill
        # lands anywhere in it. The cluster changes meanwhile, as it would in real life.
        time.sleep(rng.uniform(0.5, 2.5))
        if i % 3 == 0:
            kubelet(fail_one=i % 6 == 0)
        if i == 5:
            crd.kubectl("delete", "rljob", "delta", "-n", namespace, "--wait=false")
        if i == 8:
            api.merge(f"{rljobs}/charlie", {"spec": {"suspend": True}})
        if i == 12:
            apply(job("echo", namespace))
        if i == 15:
            api.merge(f"{rljobs}/charlie", {"spec": {"suspend": False}})
        time.sleep(rng.uniform(0.0, 1.0))
        kill(proc)
        kills += 1
    assert kills >= 20

    proc = start_operator(crd.kubeconfig, namespace, SETTINGS, tmp_path, "final")
    try:
        deadline = time.monotonic() + 120
        while True:
            problems = check_exact_children(api, namespace)
            if not problems:
                break
            if time.monotonic() > deadline:
                log = (tmp_path / "operator-final.log").read_text()[-3000:]
                raise AssertionError(
                    "did not converge:\n" + "\n".join(problems) + "\n--- operator log ---\n" + log
                )
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def check_exact_children(api: SyncApi, namespace: str) -> list[str]:
    problems: list[str] = []
    jobs = {
        j["metadata"]["name"]: j for j in api.list(f"/apis/polyrl.dev/v1alpha1/namespaces/{namespace}/rljobs")
    }
    if set(jobs) != {"alpha", "bravo", "charlie", "echo"}:
        problems.append(f"jobs: {sorted(jobs)}")
    expected: dict[tuple[str, str], dict[str, Any]] = {}
    settings = OperatorSettings()
    for name, body in jobs.items():
        status = body.get("status") or {}
        if status.get("observedGeneration") != body["metadata"]["generation"]:
            problems.append(f"{name}: observedGeneration {status.get('observedGeneration')}")
        for manifest in render(body, settings, namespace=namespace):
            manifest["_uid"] = body["metadata"]["uid"]
            manifest["_attempt"] = str(status.get("restarts", 0))
            expected[(manifest["kind"], manifest["metadata"]["name"])] = manifest
    live: dict[tuple[str, str], dict[str, Any]] = {}
    for kind, collection in CHILD_KINDS.items():
        for item in api.list(collection.format(ns=namespace), naming.LABEL_JOB):
            live[(kind, item["metadata"]["name"])] = item
    for key in sorted(set(live) - set(expected)):
        problems.append(f"orphan or surplus {key}")
    for key in sorted(set(expected) - set(live)):
        problems.append(f"missing {key}")
    for key in sorted(set(live) & set(expected)):
        obj, want = live[key], expected[key]
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            problems.append(f"terminating {key}")
        if [o["uid"] for o in meta.get("ownerReferences") or []] != [want["_uid"]]:
            problems.append(f"{key}: owner {meta.get('ownerReferences')}")
        if key[0] == "Pod":
            attempt = meta["labels"].get(naming.LABEL_ATTEMPT)
            if attempt is not None and attempt != want["_attempt"]:
                problems.append(f"{key}: attempt {attempt} != restarts {want['_attempt']}")
            if (obj.get("status") or {}).get("phase") == "Failed":
                problems.append(f"{key}: still Failed")
            if (
                attempt in (None, "0")
                and meta["annotations"][naming.ANNOTATION_HASH]
                != want["metadata"]["annotations"][naming.ANNOTATION_HASH]
            ):
                problems.append(f"{key}: content differs from render")
        elif (
            meta["annotations"][naming.ANNOTATION_HASH]
            != want["metadata"]["annotations"][naming.ANNOTATION_HASH]
        ):
            problems.append(f"{key}: content differs from render")
    return problems
