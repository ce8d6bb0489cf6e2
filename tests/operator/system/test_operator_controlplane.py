"""The operator against the real Kubernetes API machinery (CRD server + shim): the RLJob CRD and
Kueue's real CRDs installed, the test playing kubelet (pod status), the runtime (/progress) and
Kueue (Workload admission)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator import naming, pod_contract
from polyrl_operator.kube import CHILD_API_VERSIONS, ApiError, Credentials, KubeClient, path_for
from polyrl_operator.settings import Autoscale, OperatorSettings
from polyrl_testenv.bad_rljobs import CPU_EXAMPLE, EXAMPLES, REPO
from polyrl_testenv.kueue import admission_status
from polyrl_testenv.operator_fixtures import PROGRESS_SAMPLES, SIGNAL_GAME_PODS, pod_status
from polyrl_testenv.operator_harness import FakeCoordinator, eventually, operator_in_process
from polyrl_testenv.quota_proxy import QuotaProxy

pytestmark = pytest.mark.controlplane

KUEUE_DIR = REPO / "tests" / "data" / "kueue"  # Kueue's own CRDs, vendored
RLJOBS = "polyrl.dev/v1alpha1"
WORKLOADS = "kueue.x-k8s.io/v1beta2"


def kueue_crds() -> list[Path]:
    return sorted(KUEUE_DIR.glob("kueue.x-k8s.io_*.yaml"))


@pytest.fixture(scope="module")
def cluster(controlplane: Any) -> Iterator[Any]:
    files = [REPO / "crds" / "polyrl.dev_rljobs.yaml", *kueue_crds()]
    for path in files:
        result = controlplane.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", str(path), timeout=120
        )
        assert result.returncode == 0, result.stderr
    waited = controlplane.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    assert waited.returncode == 0, waited.stderr
    yield controlplane


def fast_settings(coordinator: FakeCoordinator) -> OperatorSettings:
    return OperatorSettings(
        resync_seconds=1,
        progress_interval=0.2,
        progress_timeout=2,
        progress_url=coordinator.url,
        autoscale=Autoscale(out_window=0, in_window=0, cooldown=0),
        quota_backoff=0.5,
        quota_backoff_max=1,
        error_backoff=0.2,
        metrics_port=None,
        liveness_port=None,
    )


@pytest.fixture
async def coordinator() -> AsyncIterator[FakeCoordinator]:
    fake = FakeCoordinator()
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def api(cluster: Any) -> AsyncIterator[KubeClient]:
    client = KubeClient(Credentials(server=cluster.server))
    yield client
    await client.close()


class Cluster:
    """Async helpers on the test's namespace."""

    def __init__(self, cp: Any, api: KubeClient, namespace: str) -> None:
        self.cp, self.api, self.ns = cp, api, namespace

    async def kubectl(self, *args: str, input: str | None = None) -> Any:
        return await asyncio.to_thread(self.cp.kubectl, *args, "-n", self.ns, input=input, timeout=120)

    async def apply(self, doc: dict[str, Any]) -> None:
        result = await self.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        assert result.returncode == 0, result.stderr

    async def job(self, name: str) -> dict[str, Any]:
        return await self.api.get(path_for(RLJOBS, "RLJob", self.ns, name))

    async def pods(self, job: str) -> dict[str, dict[str, Any]]:
        items = await self.api.list(path_for("v1", "Pod", self.ns), f"{naming.LABEL_JOB}={job}")
        return {p["metadata"]["name"]: p for p in items}

    async def pod_names(self, job: str) -> set[str]:
        return set(await self.pods(job))

    async def kubelet(self, job: str, phase: str = "Running", only: set[str] | None = None) -> None:
        for name in await self.pod_names(job):
            if only is None or name in only:
                await self.set_pod_status(name, pod_status(phase))

    async def set_pod_status(self, name: str, status: dict[str, Any]) -> None:
        await self.api.patch(path_for("v1", "Pod", self.ns, name, "status"), {"status": status})

    async def condition(self, job: str, ctype: str) -> dict[str, Any]:
        status = (await self.job(job)).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == ctype), {})

    async def events(self) -> list[str]:
        items = await self.api.list(path_for("v1", "Event", self.ns))
        return [e["reason"] for e in items]

    async def printed(self, job: str) -> dict[str, str]:
        """The row of ``kubectl get rljobs -o wide`` for ``job``, by column header (the server's
        printer columns, as a user sees them)."""
        result = await self.kubectl("get", "rljobs", "-o", "wide")
        assert result.returncode == 0, result.stderr
        header, *rows = result.stdout.splitlines()
        starts = [m.start() for m in re.finditer(r"\S+", header)]
        names = header.split()
        row = next(r for r in rows if r.split()[0] == job)
        bounds = [*starts[1:], None]
        return {n: row[a:b].strip() for n, a, b in zip(names, starts, bounds, strict=True)}

    async def wait_for(self, job: str, condition: str) -> None:
        result = await self.kubectl("wait", f"--for=condition={condition}", "--timeout=60s", f"rljob/{job}")
        assert result.returncode == 0, result.stderr


@pytest.fixture
def k8s(cluster: Any, api: KubeClient, namespace: str) -> Cluster:
    return Cluster(cluster, api, namespace)


def cpu_job() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(CPU_EXAMPLE.read_text())
    return doc


def progress_doc(name: str, **replace: str) -> dict[str, Any]:
    text = (PROGRESS_SAMPLES / f"{name}.json").read_text()
    for old, new in replace.items():
        text = text.replace(old, new)
    doc: dict[str, Any] = json.loads(text)
    return doc


async def test_full_lifecycle_with_kubectl_wait_and_gitops_invariance(
    k8s: Cluster, coordinator: FakeCoordinator
) -> None:
    async with operator_in_process(k8s.cp.server, fast_settings(coordinator), namespaces=[k8s.ns]):
        doc = cpu_job()
        await k8s.apply(doc)

        async def created() -> bool:
            return await k8s.pod_names("signal-game") == SIGNAL_GAME_PODS

        await eventually(created)
        initial = await k8s.job("signal-game")  # as stored: the user's spec with the server's defaults
        services = {s["metadata"]["name"] for s in await k8s.api.list(path_for("v1", "Service", k8s.ns))}
        assert len(services) == 6
        await k8s.kubelet("signal-game")
        await k8s.wait_for("signal-game", "Ready")
        assert (await k8s.job("signal-game"))["status"]["phase"] == "Running"

        # Elasticity: backlog -> scale out (status only), idle -> drain -> delete.
        coordinator.documents[(k8s.ns, "signal-game")] = progress_doc("running")

        async def scaled_out() -> bool:
            return "signal-game-speaker-rollout-1" in await k8s.pod_names("signal-game")

        await eventually(scaled_out)
        # `kubectl get rljobs` shows each policy's version and the job's step.
        row = await k8s.printed("signal-game")
        assert row["POLICIES"] == "speaker:v12 listener:v11" and row["STEP"] == "11"
        assert row["PHASE"] == "Running" and row["TOTAL"] == "80" and row["STARTED"] not in ("", "<none>")
        assert row["COMPLETED"] in ("", "<none>")  # not finished
        await k8s.kubelet("signal-game", only={"signal-game-speaker-rollout-1"})
        coordinator.documents[(k8s.ns, "signal-game")] = progress_doc("idle")

        async def draining() -> bool:
            pod = (await k8s.pods("signal-game")).get("signal-game-speaker-rollout-1") or {}
            return (pod.get("metadata", {}).get("annotations") or {}).get(
                pod_contract.ANNOTATION_DRAIN
            ) == "true"

        await eventually(draining)
        coordinator.documents[(k8s.ns, "signal-game")] = progress_doc("draining")

        async def drained() -> bool:
            return await k8s.pod_names("signal-game") == SIGNAL_GAME_PODS

        await eventually(drained)

        # Suspend (a user edit): checkpoint first, then no pods, status kept.
        assert (
            await k8s.kubectl(
                "patch", "rljob", "signal-game", "--type=merge", "-p", '{"spec":{"suspend":true}}'
            )
        ).returncode == 0

        async def checkpoint_requested() -> str | None:
            pod = (await k8s.pods("signal-game")).get("signal-game-coordinator") or {}
            return (pod.get("metadata", {}).get("annotations") or {}).get(
                pod_contract.ANNOTATION_CHECKPOINT_REQUEST
            )

        request = await eventually(checkpoint_requested)
        assert await k8s.pod_names("signal-game") == SIGNAL_GAME_PODS
        coordinator.documents[(k8s.ns, "signal-game")] = progress_doc("checkpointed", REQUEST=request)
        await k8s.wait_for("signal-game", "Suspended")
        assert await k8s.pod_names("signal-game") == set()
        assert (await k8s.job("signal-game"))["status"]["policies"][0]["lastCheckpointStep"] == 40

        # Resume, then the coordinator fails: the training roles restart, counted once.
        del coordinator.documents[(k8s.ns, "signal-game")]
        assert (
            await k8s.kubectl(
                "patch", "rljob", "signal-game", "--type=merge", "-p", '{"spec":{"suspend":false}}'
            )
        ).returncode == 0
        await eventually(created)
        await k8s.kubelet("signal-game")
        await k8s.wait_for("signal-game", "Ready")
        await k8s.set_pod_status("signal-game-coordinator", pod_status("Failed"))

        async def restarted() -> bool:
            pods = await k8s.pods("signal-game")
            return set(pods) == SIGNAL_GAME_PODS and all(
                p["metadata"]["labels"].get(naming.LABEL_ATTEMPT) in (None, "1") for p in pods.values()
            )

        await eventually(restarted)
        assert (await k8s.job("signal-game"))["status"]["restarts"] == 1

        # Then a trainer fails: its pod alone is replaced, in attempt 1; the job does not restart.
        await k8s.kubelet("signal-game")
        trainer = "signal-game-listener-trainer-0"
        uid = (await k8s.pods("signal-game"))[trainer]["metadata"]["uid"]
        await k8s.set_pod_status(trainer, pod_status("Failed"))

        async def replaced() -> bool:
            pod = (await k8s.pods("signal-game")).get(trainer)
            return (
                pod is not None
                and pod["metadata"]["uid"] != uid
                and not pod["metadata"].get("deletionTimestamp")
            )

        await eventually(replaced)
        assert (await k8s.pods("signal-game"))[trainer]["metadata"]["labels"][naming.LABEL_ATTEMPT] == "1"
        assert (await k8s.job("signal-game"))["status"]["restarts"] == 1

        # The coordinator reports done.
        await k8s.kubelet("signal-game")
        coordinator.documents[(k8s.ns, "signal-game")] = progress_doc("done")
        await k8s.wait_for("signal-game", "Succeeded")

        final = await k8s.job("signal-game")
        assert final["status"]["phase"] == "Succeeded"
        row = await k8s.printed("signal-game")
        assert row["POLICIES"] == "speaker:v60 listener:v60" and row["STEP"] == "60"
        assert row["PHASE"] == "Succeeded" and row["COMPLETED"] not in ("", "<none>")
        assert final["status"]["restarts"] == 1
        # GitOps: the operator never wrote spec. Only the user's two edits bumped the generation,
        # and spec is exactly what the user last applied.
        assert final["metadata"]["generation"] == initial["metadata"]["generation"] + 2
        assert final["spec"] == initial["spec"]  # suspend true then false again: the same spec
        assert final["status"]["observedGeneration"] == final["metadata"]["generation"]
        reasons = set(await k8s.events())
        assert {
            "CreatedPods",
            "Scaled",
            "Draining",
            "CheckpointRequested",
            "Restarting",
            "Replacing",
            "Succeeded",
        } <= reasons


async def test_operator_rejects_what_the_crd_accepts(k8s: Cluster, coordinator: FakeCoordinator) -> None:
    doc = cpu_job()
    doc["metadata"]["name"] = "bad-labels"
    doc["spec"]["policies"][0]["trainer"]["podTemplate"] = {"metadata": {"labels": {"polyrl.dev/job": "x"}}}
    async with operator_in_process(k8s.cp.server, fast_settings(coordinator), namespaces=[k8s.ns]) as op:
        await k8s.apply(doc)  # the API server accepts it
        await k8s.wait_for("bad-labels", "Failed")
        failed = await k8s.condition("bad-labels", "Failed")
        assert failed["reason"] == "InvalidSpec"
        assert "spec.policies[0].trainer.podTemplate.metadata.labels" in failed["message"]
        assert await k8s.pod_names("bad-labels") == set()
        writes = op.client.writes
        before = op.reconciler.reconciles
        await eventually(lambda: _more(op.reconciler, before + 2))  # resyncs happen...
        assert op.client.writes == writes  # ...and write nothing: no retry loop


async def _more(reconciler: Any, n: int) -> bool:
    return bool(reconciler.reconciles >= n)


async def test_kueue_admission_gates_pods_and_eviction_suspends(
    k8s: Cluster, coordinator: FakeCoordinator
) -> None:
    assert kueue_crds(), f"Kueue CRDs missing from {KUEUE_DIR}"
    flavor = {
        "apiVersion": WORKLOADS,
        "kind": "ResourceFlavor",
        "metadata": {"name": f"cpu-{k8s.ns}"},
        "spec": {
            "nodeLabels": {"pool": "cpu-spot"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }
    result = await k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(flavor))
    assert result.returncode == 0, result.stderr
    priority_class = {
        "apiVersion": WORKLOADS,
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": f"batch-{k8s.ns}"},
        "value": 1500,
        "description": "RL training",
    }
    doc = cpu_job()
    doc["spec"]["scheduling"] = {
        "queueName": "team-a",
        "priorityClassName": priority_class["metadata"]["name"],
    }
    async with operator_in_process(k8s.cp.server, fast_settings(coordinator), namespaces=[k8s.ns]):
        await k8s.apply(doc)
        workload_path = path_for(WORKLOADS, "Workload", k8s.ns, "signal-game")

        async def workload() -> dict[str, Any] | None:
            try:
                return await k8s.api.get(workload_path)
            except ApiError:
                return None

        # The class does not exist yet: the job waits, naming the field, and has no Workload.
        async def missing_class() -> bool:
            admitted = await k8s.condition("signal-game", "Admitted")
            return admitted.get("reason") == "PriorityNotFound"

        await eventually(missing_class)
        admitted = await k8s.condition("signal-game", "Admitted")
        assert admitted["message"].startswith("spec.scheduling.priorityClassName:"), admitted
        assert await workload() is None and "PriorityNotFound" in await k8s.events()
        result = await k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(priority_class))
        assert result.returncode == 0, result.stderr

        wl = await eventually(workload)  # the resync finds the class
        assert wl["metadata"]["ownerReferences"][0]["kind"] == "RLJob"
        assert wl["spec"]["priorityClassRef"] == {
            "group": "kueue.x-k8s.io",
            "kind": "WorkloadPriorityClass",
            "name": priority_class["metadata"]["name"],
        }
        assert wl["spec"]["priority"] == 1500
        podsets = [(p["name"], p["count"]) for p in wl["spec"]["podSets"]]
        assert podsets == [
            ("coordinator", 1),
            ("workflow", 2),
            ("speaker-rollout", 2),
            ("speaker-trainer", 1),
            ("listener-rollout", 2),
            ("listener-trainer", 1),
        ]
        await k8s.wait_for("signal-game", "Progressing=False")  # pending admission
        assert await k8s.pod_names("signal-game") == set()
        assert (await k8s.condition("signal-game", "Admitted"))["status"] == "False"
        now = "2026-01-01T00:00:00Z"
        status = admission_status("cluster-cpu", podsets, {"cpu": flavor["metadata"]["name"]})
        admission = {"status": status}
        await k8s.api.patch(workload_path + "/status", admission)
        await k8s.wait_for("signal-game", "Admitted")

        async def created() -> bool:
            return await k8s.pod_names("signal-game") == SIGNAL_GAME_PODS

        await eventually(created)
        pod = (await k8s.pods("signal-game"))["signal-game-speaker-trainer-0"]
        assert "priorityClassName" not in pod["spec"]  # a WorkloadPriorityClass is Kueue's alone
        assert pod["spec"]["nodeSelector"] == {"pool": "cpu-spot"}
        assert pod["spec"]["tolerations"] == flavor["spec"]["tolerations"]
        evicted = {
            "status": {
                "conditions": [
                    *admission["status"]["conditions"],
                    {
                        "type": "Evicted",
                        "status": "True",
                        "reason": "Preempted",
                        "message": "preempted by a higher priority workload",
                        "lastTransitionTime": now,
                    },
                ]
            }
        }
        await k8s.api.patch(workload_path + "/status", evicted)
        await k8s.wait_for("signal-game", "Suspended")
        assert await k8s.pod_names("signal-game") == set()
        assert "preempted" in (await k8s.condition("signal-game", "Suspended"))["message"]
        assert (await k8s.api.get(workload_path))["spec"]["active"] is True
        assert (
            await k8s.kubectl(
                "patch", "rljob", "signal-game", "--type=merge", "-p", '{"spec":{"suspend":true}}'
            )
        ).returncode == 0

        async def inactive() -> bool:
            return (await k8s.api.get(workload_path))["spec"]["active"] is False

        await eventually(inactive)
    await k8s.kubectl("delete", "resourceflavor", flavor["metadata"]["name"])
    await k8s.kubectl("delete", "workloadpriorityclass", priority_class["metadata"]["name"])


async def test_quota_refusal_removes_the_partial_job_and_retries(
    k8s: Cluster, coordinator: FakeCoordinator
) -> None:
    proxy = QuotaProxy(k8s.cp.server, limit=4)
    await proxy.start()
    try:
        async with operator_in_process(proxy.url, fast_settings(coordinator), namespaces=[k8s.ns]):
            await k8s.apply(cpu_job())
            await k8s.wait_for("signal-game", "QuotaExceeded")
            quota = await k8s.condition("signal-game", "QuotaExceeded")
            assert "exceeded quota" in quota["message"]

            async def rolled_back() -> bool:
                return await k8s.pod_names("signal-game") == set() and proxy.refusals >= 2

            await eventually(rolled_back)  # retried with backoff, each time all or nothing
            assert (await k8s.job("signal-game"))["status"]["phase"] == "Pending"
            proxy.limit = 10

            async def created() -> bool:
                return await k8s.pod_names("signal-game") == SIGNAL_GAME_PODS

            await eventually(created)
            await k8s.wait_for("signal-game", "QuotaExceeded=False")
            assert "QuotaExceeded" in await k8s.events()
    finally:
        await proxy.stop()


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
async def test_examples_reconcile_to_what_render_prints(
    k8s: Cluster, coordinator: FakeCoordinator, path: Path
) -> None:
    from polyrl_operator.planning import render

    settings = fast_settings(coordinator)
    doc = yaml.safe_load(path.read_text())
    doc["metadata"]["namespace"] = k8s.ns
    doc["spec"].pop("scheduling", None)  # no Kueue admission in this test
    async with operator_in_process(k8s.cp.server, settings, namespaces=[k8s.ns]):
        await k8s.apply(doc)
        live_job = await k8s.job(doc["metadata"]["name"])  # with its uid: owner references are exact
        expected = {(m["kind"], m["metadata"]["name"]): m for m in render(live_job, settings)}

        async def converged() -> bool:
            live = {}
            for kind in settings.child_kinds():
                if kind == "Workload":
                    continue  # no Kueue admission in this test
                for item in await k8s.api.list(path_for(CHILD_API_VERSIONS[kind], kind, k8s.ns)):
                    live[(kind, item["metadata"]["name"])] = item
            if set(live) != set(expected):
                return False
            return all(
                live[key]["metadata"]["annotations"][naming.ANNOTATION_HASH]
                == expected[key]["metadata"]["annotations"][naming.ANNOTATION_HASH]
                for key in expected
            )

        await eventually(converged)
