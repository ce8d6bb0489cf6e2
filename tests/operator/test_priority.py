"""A job's priority for Kueue (``spec.scheduling.priorityClassName``), resolved as Kueue does: a
WorkloadPriorityClass of that name first, then a PriorityClass. Table-driven for the pure rules
(resolution, which jobs need it, what a Workload records, where it lands on the Workload and the
pods); the reconciler step by step against the in-memory API (wait for a missing class, then the
Workload with it, and no lookup once the Workload records it); the lookup against the control
plane's PriorityClasses. tests/operator/test_operator_controlplane.py runs a WorkloadPriorityClass
through the real operator and Kueue's CRDs."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from polyrl_operator.api import RLJob
from polyrl_operator.builders.common import JobRef
from polyrl_operator.builders.priority import Priority, PriorityNotFound, recorded_priority, resolve_priority
from polyrl_operator.builders.workload import build_workload
from polyrl_operator.kube import KubeClient, load_credentials
from polyrl_operator.priority import class_to_resolve, lookup_priority
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv import ControlPlane
from polyrl_testenv.operator_fixtures import Sim, gpu_job

WPC = {"rl-batch": 1000, "shared": 50}
PC = {"shared": 7, "system-cluster-critical": 2000000000}

RESOLVE_CASES: list[tuple[str, str | None, Priority | PriorityNotFound | None]] = [
    ("no class named", None, None),
    ("empty name", "", None),
    ("a WorkloadPriorityClass", "rl-batch", Priority("rl-batch", "WorkloadPriorityClass", 1000)),
    ("both exist: the WorkloadPriorityClass wins", "shared", Priority("shared", "WorkloadPriorityClass", 50)),
    ("only a PriorityClass", "system-cluster-critical", Priority("system-cluster-critical", "PriorityClass", 2000000000)),
    ("neither", "missing", PriorityNotFound("missing")),
]  # fmt: skip


@pytest.mark.parametrize(("case", "name", "expected"), RESOLVE_CASES, ids=[c[0] for c in RESOLVE_CASES])
def test_resolve_priority(case: str, name: str | None, expected: Priority | PriorityNotFound | None) -> None:
    assert resolve_priority(name, WPC, PC) == expected


WORKLOAD_CASES: list[tuple[str, Priority | None, dict[str, Any], str | None]] = [
    ("no priority", None, {}, None),
    (
        "WorkloadPriorityClass: Workload only, pods name no class",
        Priority("rl-batch", "WorkloadPriorityClass", 1000),
        {"priorityClassRef": {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "rl-batch"},
         "priority": 1000},
        None,
    ),
    (
        "PriorityClass: the Workload and the pods",
        Priority("high", "PriorityClass", 100),
        {"priorityClassRef": {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "high"}, "priority": 100},
        "high",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "priority", "fields", "pod_class"), WORKLOAD_CASES, ids=[c[0] for c in WORKLOAD_CASES]
)
def test_workload_carries_the_priority(
    case: str, priority: Priority | None, fields: dict[str, Any], pod_class: str | None
) -> None:
    body = gpu_job()
    job = RLJob.model_validate({**body, "metadata": {"name": "debate", "namespace": "team-a"}})
    ref = JobRef("debate", "team-a", "uid-1")
    workload = build_workload(job, ref, OperatorSettings(), active=True, priority=priority)
    plain = build_workload(job, ref, OperatorSettings(), active=True)
    assert {k: v for k, v in workload["spec"].items() if k.startswith("priority")} == fields
    # Kueue refuses a priorityClassRef change once quota is reserved: it is part of the hash.
    assert (workload["metadata"]["annotations"] == plain["metadata"]["annotations"]) == (priority is None)
    assert (priority.pod_priority_class_name if priority else None) == pod_class


TO_RESOLVE_CASES: list[tuple[str, dict[str, Any], dict[str, str], bool, str | None]] = [
    ("queue in the spec", {"queueName": "team-a", "priorityClassName": "high"}, {}, True, "high"),
    ("queue from the label", {"priorityClassName": "high"}, {"kueue.x-k8s.io/queue-name": "q"}, True, "high"),
    ("no queue: the pods' own class, nothing to resolve", {"priorityClassName": "high"}, {}, True, None),
    ("Kueue off", {"queueName": "team-a", "priorityClassName": "high"}, {}, False, None),
    ("no class named", {"queueName": "team-a"}, {}, True, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "scheduling", "labels", "kueue", "expected"),
    TO_RESOLVE_CASES,
    ids=[c[0] for c in TO_RESOLVE_CASES],
)
def test_which_jobs_need_their_class_resolved(
    case: str, scheduling: dict[str, Any], labels: dict[str, str], kueue: bool, expected: str | None
) -> None:
    body = {"metadata": {"name": "j", "labels": labels}, "spec": {"scheduling": scheduling}}
    assert class_to_resolve(body, kueue) == expected


def _prio_gets(sim: Sim) -> int:
    return sum(1 for verb, path in sim.api.log if path.split("/")[0].endswith("priorityclasses"))


async def test_the_reconciler_waits_for_a_missing_class_then_creates_the_workload_with_it() -> None:
    body = gpu_job()
    body["spec"]["scheduling"]["priorityClassName"] = "rl-batch"
    sim = Sim(body)
    await sim.step()
    await sim.step()
    assert sim.api.names("workloads") == set() and sim.pods() == set()
    admitted = sim.condition("Admitted")
    assert (admitted["status"], admitted["reason"]) == ("False", "PriorityNotFound")
    assert admitted["message"].startswith("spec.scheduling.priorityClassName:")
    assert sim.status["phase"] == "Pending"
    events = [o for (pl, _, _), o in sim.api.objects.items() if pl == "events"]
    assert [e["reason"] for e in events if e["reason"] == "PriorityNotFound"] == ["PriorityNotFound"]
    assert not [k for k in sim.kicks if k < 1], "a missing class is re-checked on the resync, not at once"
    # The admin creates the class: the next reconcile (the resync) creates the Workload with it.
    sim.api._create("workloadpriorityclasses", None, {"metadata": {"name": "rl-batch"}, "value": 1000})
    await sim.step()
    workload = sim.api.obj("workloads", "debate")
    assert workload["spec"]["priorityClassRef"]["kind"] == "WorkloadPriorityClass"
    assert workload["spec"]["priority"] == 1000
    assert {"priorityClassName"} & set(workload["spec"]["podSets"][0]["template"]["spec"]) == set()
    assert sim.condition("Admitted")["reason"] == "WorkloadCreating"
    # From now on the Workload records the class: no lookup per reconcile, and a class whose value
    # changes (or that goes) does not replace a Workload that exists.
    before = _prio_gets(sim)
    sim.api.objects[("workloadpriorityclasses", None, "rl-batch")]["value"] = 5
    await sim.step()
    await sim.step()
    assert _prio_gets(sim) == before
    assert sim.api.obj("workloads", "debate")["metadata"]["uid"] == workload["metadata"]["uid"]


RECORDED_CASES: list[tuple[str, tuple[str, str, int] | None, str, Priority | None]] = [
    ("no Workload record", None, "rl-batch", None),
    ("the class named", ("WorkloadPriorityClass", "rl-batch", 10), "rl-batch", Priority("rl-batch", "WorkloadPriorityClass", 10)),
    ("a PriorityClass", ("PriorityClass", "high", 7), "high", Priority("high", "PriorityClass", 7)),
    ("another class: the spec changed, look again", ("PriorityClass", "high", 7), "rl-batch", None),
    ("a kind Kueue does not know", ("Other", "rl-batch", 7), "rl-batch", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "recorded", "name", "expected"), RECORDED_CASES, ids=[c[0] for c in RECORDED_CASES]
)
def test_a_workloads_record_answers_for_its_class(
    case: str, recorded: tuple[str, str, int] | None, name: str, expected: Priority | None
) -> None:
    assert recorded_priority(recorded, name) == expected


def test_the_priority_value_is_not_part_of_the_workload_hash() -> None:
    body = gpu_job()
    job = RLJob.model_validate({**body, "metadata": {"name": "debate", "namespace": "team-a"}})
    ref = JobRef("debate", "team-a", "uid-1")
    low, high = (
        build_workload(job, ref, OperatorSettings(), active=True, priority=Priority("p", "PriorityClass", v))
        for v in (1, 2)
    )
    assert (low["spec"]["priority"], high["spec"]["priority"]) == (1, 2)
    assert low["metadata"]["annotations"] == high["metadata"]["annotations"]


def test_a_missing_class_names_the_field() -> None:
    message = PriorityNotFound("rl-batch").message
    assert message.startswith("spec.scheduling.priorityClassName:") and "'rl-batch'" in message


@pytest.mark.controlplane
def test_lookup_against_the_api_server(controlplane: ControlPlane) -> None:
    name = f"t-prio-{uuid.uuid4().hex[:6]}"
    body = {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name},
        "value": 4242,
    }
    code, created = controlplane.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", body)
    assert code == 201, created

    async def lookups() -> list[Priority | PriorityNotFound | None]:
        client = KubeClient(load_credentials(str(controlplane.kubeconfig)))
        try:
            return [await lookup_priority(client, n) for n in (name, "no-such-class", None)]
        finally:
            await client.close()

    try:
        found, missing, unset = asyncio.run(lookups())
    finally:
        controlplane.request("DELETE", f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")
    assert found == Priority(name, "PriorityClass", 4242)
    assert missing == PriorityNotFound("no-such-class")
    assert unset is None
