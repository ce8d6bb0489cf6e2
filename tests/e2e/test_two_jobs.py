"""Scenario 8: two RLJobs of the same name in two namespaces at once, one admitted through Kueue by
the test, one without: both train to Succeeded and neither touches the other's pods."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import yaml

from polyrl_testenv import ControlPlane
from polyrl_testenv.kueue import admission_status

from .conftest import E2E, accounted, selfplay

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

JOB = "selfplay"
WORKLOADS = "/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads"


def admit(e2e: E2E, namespace: str) -> list[tuple[str, int]]:
    """Play Kueue: admit the job's Workload (what a ClusterQueue with free quota does)."""
    path = WORKLOADS.format(ns=namespace) + f"/{JOB}"
    code, wl = e2e.cp.request("GET", path)
    assert code == 200, wl
    podsets = [(p["name"], p["count"]) for p in wl["spec"]["podSets"]]
    admission = admission_status("cluster-cpu", podsets, {"cpu": "default"})
    e2e.kubectl("patch", "workload", JOB, "-n", namespace, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": admission}))  # fmt: skip
    return podsets


def test_two_jobs_in_two_namespaces_one_through_kueue_do_not_interfere(
    e2e: E2E, cluster: ControlPlane, namespace: str
) -> None:
    other = f"t-two-jobs-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(other)
    try:
        e2e.kubelet.serve(other)
        e2e.namespaces.append(other)
        flavor = {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": "default"},
        }
        e2e.kubectl("apply", "-f", "-", input=yaml.safe_dump(flavor))
        e2e.start_operator(kueue={"enabled": True})
        queued = selfplay(
            training={"totalSteps": 8, "episodesPerStep": 8, "seed": 3}, scheduling={"queueName": "team-a"}
        )
        e2e.apply(queued, namespace)
        e2e.apply(selfplay(training={"totalSteps": 8, "episodesPerStep": 8, "seed": 5}), other)

        e2e.eventually(lambda: e2e.step(JOB, other) >= 1, timeout=240, what="the unqueued job training")
        assert e2e.pods(namespace) == {}  # the queued one waits for admission, whatever the other does
        assert e2e.condition(JOB, namespace, "Admitted")["status"] == "False"
        podsets = admit(e2e, namespace)
        assert [n for n, _ in podsets] == ["coordinator", "workflow", "agent-rollout", "agent-trainer"]

        e2e.wait(JOB, namespace, "Succeeded", timeout=400)
        e2e.wait(JOB, other, "Succeeded", timeout=400)
        for ns in (namespace, other):
            counters: dict[str, Any] = e2e.counters(JOB, ns)
            accounted(counters)
            assert counters["steps"] == {"agent": 8}
            runs = e2e.kubelet.started(ns)
            assert len(runs) == 4 and all(r.namespace == ns for r in runs)
            # each job's pods reached only their own job's Ray head: the join address in their logs
            heads = {json.loads(line)["address"] for r in runs
                     for line in (r.directory / "main.log").read_text().splitlines() if "worker.joined" in line}  # fmt: skip
            assert len(heads) == 1, heads
        ports = [{json.loads(line)["address"] for r in e2e.kubelet.started(ns)
                  for line in (r.directory / "main.log").read_text().splitlines() if "worker.joined" in line}
                 for ns in (namespace, other)]  # fmt: skip
        assert ports[0] != ports[1]
    finally:
        cluster.delete_namespace(other)
