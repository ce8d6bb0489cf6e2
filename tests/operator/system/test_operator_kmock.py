"""The operator's kopf handlers against kopf's own Kubernetes emulator (kmock): fast, no cluster."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml

from polyrl_operator.kube import ApiError, Credentials, KubeClient, path_for
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv.bad_rljobs import CPU_EXAMPLE
from polyrl_testenv.operator_fixtures import SIGNAL_GAME_PODS
from polyrl_testenv.operator_harness import RunningOperator, eventually, operator_in_process

NS = "team-a"
VERBS = {"get", "list", "watch", "create", "patch", "delete"}
RESOURCES = {
    "polyrl.dev/v1alpha1/rljobs": {
        "kind": "RLJob",
        "namespaced": True,
        "verbs": VERBS,
        "subresources": {"status"},
    },
    "v1/pods": {"kind": "Pod", "namespaced": True, "verbs": VERBS, "subresources": {"status"}},
    "v1/services": {"kind": "Service", "namespaced": True, "verbs": VERBS},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True, "verbs": VERBS},
    "v1/secrets": {"kind": "Secret", "namespaced": True, "verbs": VERBS},
    "v1/serviceaccounts": {"kind": "ServiceAccount", "namespaced": True, "verbs": VERBS},
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy", "namespaced": True, "verbs": VERBS},
    "v1/events": {"kind": "Event", "namespaced": True, "verbs": VERBS},
    # kopf waits for the namespaces resource in discovery before it starts any watch.
    "v1/namespaces": {"kind": "Namespace", "namespaced": False, "verbs": VERBS},
}


@pytest.fixture
async def api(kmock: Any) -> AsyncIterator[KubeClient]:
    for name, info in RESOURCES.items():
        kmock.resources[name] = info
    client = KubeClient(Credentials(server=str(kmock.url).rstrip("/")))
    yield client
    await client.close()


@pytest.fixture
async def operator(kmock: Any, api: KubeClient) -> AsyncIterator[RunningOperator]:
    settings = OperatorSettings(resync_seconds=3600, metrics_port=None, liveness_port=None)
    async with operator_in_process(str(kmock.url), settings) as op:
        yield op


def job_doc(name: str = "signal-game", uid: str = "uid-1") -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(CPU_EXAMPLE.read_text())
    doc["metadata"] = {"name": name, "namespace": NS, "uid": uid, "generation": 1}
    return doc


async def pods(api: KubeClient, job: str) -> set[str]:
    items = await api.list(path_for("v1", "Pod", NS))
    return {
        p["metadata"]["name"]
        for p in items
        if (p["metadata"].get("labels") or {}).get("polyrl.dev/job") == job
    }


async def rljob(api: KubeClient, name: str) -> dict[str, Any]:
    return await api.get(path_for("polyrl.dev/v1alpha1", "RLJob", NS, name))


async def test_rljob_gets_its_children_status_and_finalizer(
    api: KubeClient, operator: RunningOperator
) -> None:
    await api.create(path_for("polyrl.dev/v1alpha1", "RLJob", NS), job_doc())

    async def all_pods() -> bool:
        return await pods(api, "signal-game") == SIGNAL_GAME_PODS

    await eventually(all_pods)
    job = await eventually(lambda: _with_status(api, "signal-game"))
    assert job["metadata"]["finalizers"] == ["polyrl.dev/cleanup"]
    status = job["status"]
    assert status["phase"] in ("Pending", "Admitted")
    assert {p["name"]: p["rollout"]["desired"] for p in status["policies"]} == {"speaker": 1, "listener": 1}
    services = {s["metadata"]["name"] for s in await api.list(path_for("v1", "Service", NS))}
    assert services == {
        "signal-game-coordinator",
        "signal-game-workflow",
        "signal-game-speaker-rollout",
        "signal-game-speaker-trainer",
        "signal-game-listener-rollout",
        "signal-game-listener-trainer",
    }
    cm = await api.get(path_for("v1", "ConfigMap", NS, "signal-game-config"))
    assert "rljob.json" in cm["data"]
    await api.get(path_for("v1", "Secret", NS, "signal-game-ray-token"))


async def _with_status(api: KubeClient, name: str) -> dict[str, Any] | None:
    job = await rljob(api, name)
    return job if job.get("status", {}).get("conditions") else None


async def test_deleting_the_job_deletes_every_child_then_the_finalizer(
    api: KubeClient, operator: RunningOperator
) -> None:
    await api.create(path_for("polyrl.dev/v1alpha1", "RLJob", NS), job_doc())

    async def created() -> bool:
        return await pods(api, "signal-game") == SIGNAL_GAME_PODS

    await eventually(created)
    await eventually(lambda: _with_status(api, "signal-game"))
    await api.delete(path_for("polyrl.dev/v1alpha1", "RLJob", NS, "signal-game"))

    async def gone() -> bool:
        try:
            await rljob(api, "signal-game")
        except ApiError as exc:
            return exc.status == 404
        return False

    await eventually(gone)
    assert await pods(api, "signal-game") == set()
    assert await api.list(path_for("v1", "Service", NS)) == []
    assert await api.list(path_for("v1", "ConfigMap", NS)) == []
    assert await api.list(path_for("v1", "ServiceAccount", NS)) == []
    assert await api.list(path_for("networking.k8s.io/v1", "NetworkPolicy", NS)) == []


async def test_a_pod_change_reaches_the_job_through_the_index(
    api: KubeClient, operator: RunningOperator
) -> None:
    await api.create(path_for("polyrl.dev/v1alpha1", "RLJob", NS), job_doc())

    async def created() -> bool:
        return await pods(api, "signal-game") == SIGNAL_GAME_PODS

    await eventually(created)
    await eventually(lambda: _with_status(api, "signal-game"))
    failed = {"status": {"phase": "Failed", "reason": "Error", "containerStatuses": [
        {"name": "main", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}}  # fmt: skip
    await api.patch(path_for("v1", "Pod", NS, "signal-game-coordinator", "status"), failed)

    async def restarted() -> dict[str, Any] | None:
        job = await rljob(api, "signal-game")
        return job if job["status"].get("restarts") == 1 else None

    await eventually(restarted)
    events = await api.list(path_for("v1", "Event", NS))
    [restart] = [e for e in events if e["reason"] == "Restarting"]
    assert "OOMKilled" in restart["message"] and restart["involvedObject"]["name"] == "signal-game"


async def test_invalid_spec_is_reported_not_retried(api: KubeClient, operator: RunningOperator) -> None:
    doc = job_doc("no-image")
    doc["spec"]["coordinator"] = {"podTemplate": {"spec": {"containers": [{"image": "x"}]}}}
    await api.create(path_for("polyrl.dev/v1alpha1", "RLJob", NS), doc)

    async def failed() -> dict[str, Any] | None:
        job = await rljob(api, "no-image")
        return job if (job.get("status") or {}).get("phase") == "Failed" else None

    job = await eventually(failed)
    [cond] = [c for c in job["status"]["conditions"] if c["type"] == "Failed"]
    assert cond["reason"] == "InvalidSpec"
    assert "spec.coordinator.podTemplate.spec.containers[0].name" in cond["message"]
    assert await pods(api, "no-image") == set()
