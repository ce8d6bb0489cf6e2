"""The plan as a table, like KubeRay's pod_test.go: each case is (spec, observed children, progress,
clock) -> the status fields and the children the plan wants. Every case runs the pure ``plan()``;
the children are what the API server would hold after the plan before it (the test plays the kubelet
and the runtime)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from polyrl_operator import naming, pod_contract
from polyrl_operator.builders.priority import Priority, PriorityNotFound
from polyrl_operator.observed import Child
from polyrl_operator.planning import JobMemory, Plan, QuotaRefusal, plan, stored_status
from polyrl_operator.planning.conditions import rfc3339
from polyrl_operator.planning.quota import refused
from polyrl_testenv.operator_fixtures import (
    SETTINGS,
    SIGNAL_GAME_PODS,
    T0,
    children_of,
    later,
    observed,
    pod_status,
    progress,
    stored_job,
    with_status,
)

COORDINATOR = "signal-game-coordinator"
REQUEST = "deadlineexceeded-20260101T120101Z"

World = tuple[dict[str, Any], list[Child]]


def job(**spec: Any) -> dict[str, Any]:
    body = stored_job()
    body["spec"].update(spec)
    return body


def labelled(labels: dict[str, str], **spec: Any) -> dict[str, Any]:
    body = job(**spec)
    body["metadata"]["labels"] = labels
    return body


def fresh(body: dict[str, Any]) -> World:
    return body, []


def running(body: dict[str, Any], annotations: dict[str, dict[str, str]] | None = None) -> World:
    """The job after two plans: pods created at T0, all Running and ready at T0+1s."""
    first = plan(body, observed([]), SETTINGS, T0)
    children = children_of(first, default_status=pod_status(), annotations=annotations)
    second = plan(with_status(body, first), observed(children), SETTINGS, later(1))
    return with_status(body, second), children


def pending(body: dict[str, Any]) -> World:
    first = plan(body, observed([]), SETTINGS, T0)
    return with_status(body, first), children_of(first)


def checkpoint_asked(body: dict[str, Any]) -> World:
    return running(
        body,
        annotations={
            COORDINATOR: {
                pod_contract.ANNOTATION_CHECKPOINT_REQUEST: REQUEST,
                naming.ANNOTATION_CHECKPOINT_SINCE: rfc3339(later(61)),
            }
        },
    )


def with_old_status(body: dict[str, Any], status: dict[str, Any]) -> World:
    out = copy.deepcopy(body)
    out["status"] = status
    return out, []


SUCCEEDED_AT_21 = {
    "phase": "Succeeded",
    "step": 21,
    "restarts": 0,
    "startTime": "2026-01-01T12:00:00Z",
    "completionTime": "2026-01-01T12:30:00Z",
    "message": "30 steps done",
    "policies": [
        {"name": "speaker", "version": 30, "step": 30},
        {"name": "listener", "version": 30, "step": 30},
    ],
}


@dataclass(frozen=True)
class Case:
    id: str
    world: Callable[[], World]
    at: float
    """Seconds after T0."""
    expect: dict[str, Any]
    """Status fields (wire names) that must have exactly these values."""
    conditions: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Condition type -> (status, reason)."""
    pods: set[str] | None = None
    """The pods the plan wants (None: not checked)."""
    kinds: set[str] | None = None
    """Kinds the plan wants besides Pod (None: not checked)."""
    progress: str | None = None
    progress_replace: dict[str, str] = field(default_factory=dict)
    events: frozenset[str] = frozenset()
    annotated: dict[str, dict[str, str | None]] | None = None
    queue: str | None = None
    """The Workload's queueName (checked when set)."""
    priority: Priority | PriorityNotFound | None = None
    """The looked-up ``spec.scheduling.priorityClassName`` (``Observed.priority``)."""
    workload_priority: dict[str, Any] | None = None
    """The Workload's priorityClassRef and priority (checked when set)."""
    pod_classes: set[str | None] | None = None
    """The priorityClassName of every pod and Workload pod template (None: not checked)."""


INFRA = {"ConfigMap", "Secret", "ServiceAccount", "NetworkPolicy", "Service"}
QUEUED_WITH_CLASS = {"queueName": "team-a", "priorityClassName": "rl-batch"}
WPC_REF = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "rl-batch"}
PC_REF = {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "rl-batch"}
CASES = [
    Case(
        "new job: pods created, nothing ready",
        lambda: fresh(job()),
        0,
        {"phase": "Pending", "step": 0, "policySummary": "speaker:v0 listener:v0", "startTime": rfc3339(T0)},
        {"Ready": ("False", "Creating"), "Admitted": ("True", "NoQueue")},
        pods=SIGNAL_GAME_PODS,
        kinds=INFRA,
    ),
    Case(
        "pods created but not ready",
        lambda: pending(job()),
        1,
        {"phase": "Admitted", "message": "waiting for 6 pods to become ready"},
        {"Ready": ("False", "PodsNotReady"), "Progressing": ("True", "Starting")},
        pods=SIGNAL_GAME_PODS,
    ),
    Case(
        "running: the policies' versions in the summary, the smallest step",
        lambda: running(job()),
        2,
        {
            "phase": "Running",
            "step": 11,
            "policySummary": "speaker:v12 listener:v11",
            "message": "training: step 11/80",
        },
        {"Ready": ("True", "PodsReady"), "Progressing": ("True", "Training")},
        progress="running",
    ),
    Case(
        "done: Succeeded at the final step, workers freed, the coordinator kept for its logs",
        lambda: running(job()),
        2,
        {
            "phase": "Succeeded",
            "step": 60,
            "policySummary": "speaker:v60 listener:v60",
            "completionTime": rfc3339(later(2)),
        },
        {
            "Succeeded": ("True", "Succeeded"),
            "Failed": ("False", "NotFailed"),
            "Ready": ("False", "Finished"),
        },
        pods=set(),
        kinds=INFRA,
        progress="done",
        events=frozenset({"Succeeded"}),
    ),
    Case(
        "succeeded earlier: the step is the final one even with no report",
        lambda: with_old_status(job(), SUCCEEDED_AT_21),
        3600,
        {"phase": "Succeeded", "step": 30, "policySummary": "speaker:v30 listener:v30"},
        pods=set(),
    ),
    Case(
        "deadline not reached",
        lambda: running(job(activeDeadlineSeconds=60)),
        59,
        {"phase": "Running"},
        {"Failed": ("False", "NotFailed")},
        pods=SIGNAL_GAME_PODS,
    ),
    Case(
        "deadline passed: checkpoint first, pods kept",
        lambda: running(job(activeDeadlineSeconds=60)),
        61,
        {"phase": "Running"},
        {"Progressing": ("False", "DeadlineExceeded"), "Ready": ("False", "DeadlineExceeded")},
        pods=set(),
        events=frozenset({"CheckpointRequested"}),
        annotated={COORDINATOR: {pod_contract.ANNOTATION_CHECKPOINT_REQUEST: REQUEST}},
    ),
    Case(
        "deadline passed, checkpoint done: Failed with DeadlineExceeded",
        lambda: checkpoint_asked(job(activeDeadlineSeconds=60)),
        70,
        {"phase": "Failed", "completionTime": rfc3339(later(70)), "step": 40},
        {"Failed": ("True", "DeadlineExceeded"), "Succeeded": ("False", "NotSucceeded")},
        pods=set(),
        progress="checkpointed",
        progress_replace={"REQUEST": REQUEST},
        events=frozenset({"Checkpointed", "DeadlineExceeded"}),
    ),
    Case(
        "deadline passed, no checkpoint within the timeout: Failed anyway",
        lambda: checkpoint_asked(job(activeDeadlineSeconds=60)),
        61 + SETTINGS.checkpoint_timeout,
        {"phase": "Failed"},
        {"Failed": ("True", "DeadlineExceeded")},
        pods=set(),
        events=frozenset({"CheckpointTimeout", "DeadlineExceeded"}),
    ),
    Case(
        "deadline passed with no coordinator running: Failed at once",
        lambda: pending(job(activeDeadlineSeconds=60)),
        61,
        {"phase": "Failed"},
        {"Failed": ("True", "DeadlineExceeded")},
        pods=set(),
        events=frozenset({"DeadlineExceeded"}),
    ),
    Case(
        "Kueue queue from the label: a Workload, no pods until admitted",
        lambda: fresh(labelled({naming.LABEL_KUEUE_QUEUE: "team-b"})),
        0,
        {"phase": "Pending"},
        {"Admitted": ("False", "WorkloadCreating")},
        pods=set(),
        kinds=INFRA | {"Workload"},
        queue="team-b",
    ),
    Case(
        "Kueue queue in both the spec and the label: the spec wins",
        lambda: fresh(labelled({naming.LABEL_KUEUE_QUEUE: "team-b"}, scheduling={"queueName": "team-a"})),
        0,
        {"phase": "Pending"},
        pods=set(),
        queue="team-a",
    ),
    Case(
        "Kueue priority from a WorkloadPriorityClass: on the Workload only, the pods name no class",
        lambda: fresh(job(scheduling=QUEUED_WITH_CLASS)),
        0,
        {"phase": "Pending"},
        {"Admitted": ("False", "WorkloadCreating")},
        pods=set(),
        kinds=INFRA | {"Workload"},
        priority=Priority("rl-batch", "WorkloadPriorityClass", 1000),
        workload_priority={"priorityClassRef": WPC_REF, "priority": 1000},
        pod_classes={None},
    ),
    Case(
        "Kueue priority from a PriorityClass: on the Workload and its pods",
        lambda: fresh(job(scheduling=QUEUED_WITH_CLASS)),
        0,
        {"phase": "Pending"},
        {"Admitted": ("False", "WorkloadCreating")},
        pods=set(),
        kinds=INFRA | {"Workload"},
        priority=Priority("rl-batch", "PriorityClass", 7),
        workload_priority={"priorityClassRef": PC_REF, "priority": 7},
        pod_classes={"rl-batch"},
    ),
    Case(
        "Kueue priority class missing: no Workload, the job waits naming the field",
        lambda: fresh(job(scheduling=QUEUED_WITH_CLASS)),
        0,
        {"phase": "Pending", "message": PriorityNotFound("rl-batch").message},
        {"Admitted": ("False", "PriorityNotFound"), "Failed": ("False", "NotFailed")},
        pods=set(),
        kinds=INFRA,
        priority=PriorityNotFound("rl-batch"),
        events=frozenset({"PriorityNotFound"}),
    ),
    Case(
        "no queue: the pods name the PriorityClass as written",
        lambda: fresh(job(scheduling={"priorityClassName": "rl-batch"})),
        0,
        {"phase": "Pending"},
        {"Admitted": ("True", "NoQueue")},
        pods=SIGNAL_GAME_PODS,
        kinds=INFRA,
        pod_classes={"rl-batch"},
    ),
    Case(
        "invalid spec: Failed with InvalidSpec, nothing created",
        lambda: fresh(job(policies=[])),
        0,
        {"phase": "Failed"},
        {"Failed": ("True", "InvalidSpec"), "Ready": ("False", "InvalidSpec")},
        pods=set(),
        kinds=set(),
        events=frozenset({"InvalidSpec"}),
    ),
]


def test_a_queue_label_with_kueue_off_is_invalid_naming_the_label() -> None:
    settings = SETTINGS.model_copy(update={"kueue": SETTINGS.kueue.model_copy(update={"enabled": False})})
    body = labelled({naming.LABEL_KUEUE_QUEUE: "team-b"})
    result = plan(body, observed([]), settings, T0)
    assert result.status is not None and result.status.phase == "Failed"
    assert result.status.message is not None
    assert f"metadata.labels.{naming.LABEL_KUEUE_QUEUE}" in result.status.message
    assert not result.desired


@pytest.mark.parametrize(
    ("stored", "phase", "restarts"),
    [
        ({}, "Pending", 0),
        ({"phase": "Running", "restarts": 2, "someOlderField": {"x": 1}}, "Running", 2),
        ({"phase": "Running", "restarts": 2, "policies": [{"name": "a", "rewardMean": 1}]}, "Running", 2),
        ({"phase": "Exploding", "restarts": 2}, "Pending", 0),
    ],
)
def test_the_stored_status_is_read_tolerantly(stored: dict[str, Any], phase: str, restarts: int) -> None:
    status = stored_status({"status": stored})
    assert (status.phase, status.restarts) == (phase, restarts)


def _run(case: Case) -> Plan:
    body, children = case.world()
    prog = progress(case.progress, **case.progress_replace) if case.progress else None
    return plan(body, observed(children, prog, priority=case.priority), SETTINGS, later(case.at), JobMemory())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_plan_table(case: Case) -> None:
    result = _run(case)
    assert result.status is not None
    status = result.status.to_k8s()
    for key, value in case.expect.items():
        assert status.get(key) == value, (key, status.get(key))
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status.get("conditions") or []}
    for ctype, expected in case.conditions.items():
        assert conditions[ctype] == expected, ctype
    desired_pods = {name for kind, name in result.desired if kind == "Pod"}
    if case.pods is not None:
        assert desired_pods == case.pods
    if case.kinds is not None:
        assert {kind for kind, _ in result.desired if kind != "Pod"} == case.kinds
    assert case.events <= {e.reason for e in result.events}
    for pod, values in (case.annotated or {}).items():
        assert {k: v for k, v in result.annotate[pod].items() if k in values} == values
    if case.queue is not None:
        assert result.desired[("Workload", "signal-game")]["spec"]["queueName"] == case.queue
    if case.workload_priority is not None:
        spec = result.desired[("Workload", "signal-game")]["spec"]
        assert {k: v for k, v in spec.items() if k.startswith("priority")} == case.workload_priority
    if case.pod_classes is not None:
        specs = [m["spec"] for (kind, _), m in result.desired.items() if kind == "Pod"]
        workload = result.desired.get(("Workload", "signal-game"))
        specs += [ps["template"]["spec"] for ps in workload["spec"]["podSets"]] if workload else []
        assert specs and {s.get("priorityClassName") for s in specs} == case.pod_classes
    # Every printer column reads a field the status fills.
    assert {"phase", "policySummary", "step", "restarts"} <= status.keys()


def test_deadline_keeps_the_running_pods_while_checkpointing() -> None:
    result = _run(next(c for c in CASES if c.id.startswith("deadline passed: checkpoint first")))
    assert {name for kind, name in result.keep if kind == "Pod"} == SIGNAL_GAME_PODS
    assert result.requeue_after is not None and result.requeue_after <= SETTINGS.progress_interval


def test_a_running_job_with_a_deadline_looks_again_when_it_passes() -> None:
    body, children = running(job(activeDeadlineSeconds=600))
    result = plan(body, observed(children), SETTINGS, later(590), JobMemory())
    assert result.requeue_after == pytest.approx(10.0)


@dataclass(frozen=True)
class RefusalCase:
    id: str
    required: bool
    expect: dict[str, Any]
    conditions: dict[str, tuple[str, str]]


REFUSALS = [
    RefusalCase(
        "a required pod refused: rolled back, Pending",
        True,
        {"phase": "Pending", "message": "waiting for quota: exceeded quota: pods"},
        {
            "QuotaExceeded": ("True", "QuotaExceeded"),
            "Admitted": ("False", "QuotaExceeded"),
            "Ready": ("False", "QuotaExceeded"),
        },
    ),
    RefusalCase(
        "an optional pod refused: the job keeps running",
        False,
        {"phase": "Running"},
        {"QuotaExceeded": ("True", "QuotaExceeded"), "Admitted": ("False", "QuotaExceeded")},
    ),
]


@pytest.mark.parametrize("case", REFUSALS, ids=lambda c: c.id)
def test_a_quota_refusal_is_an_input_of_the_next_plan(case: RefusalCase) -> None:
    body, children = running(job())
    refusal = QuotaRefusal("exceeded quota: pods", case.required)
    after = refused(JobMemory(), refusal, status=stored_status(body), settings=SETTINGS, now=later(2))
    assert after.memory.quota_refusal == refusal and after.memory.quota_failures == 1
    assert after.event.reason == "QuotaExceeded" and after.event.message.startswith(refusal.message)
    assert after.look_again == 0  # the status does not say so yet: plan again at once
    result = plan(body, observed(children), SETTINGS, later(2), after.memory)
    assert result.status is not None
    status = result.status.to_k8s()
    for key, value in case.expect.items():
        assert status[key] == value
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    for ctype, expected in case.conditions.items():
        assert conditions[ctype] == expected
    assert result.memory.quota_refusal is None  # reported once, then forgotten
    if not case.required:
        # The status now says so: another refusal of the optional pod waits for the backoff.
        again = refused(result.memory, refusal, status=result.status, settings=SETTINGS, now=later(3))
        assert again.look_again == SETTINGS.quota_backoff * 2


def test_a_quota_refusal_is_not_news_to_a_job_being_suspended() -> None:
    body, children = running(job())
    memory = JobMemory(quota_refusal=QuotaRefusal("exceeded quota: pods", False))
    result = plan(job_with(body, suspend=True), observed(children), SETTINGS, later(2), memory)
    assert result.status is not None
    assert result.status.to_k8s()["phase"] == "Suspended"
    quota = next(c for c in result.status.to_k8s()["conditions"] if c["type"] == "QuotaExceeded")
    assert quota["status"] == "False"
    assert result.memory.quota_refusal is None


def job_with(body: dict[str, Any], **spec: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["spec"].update(spec)
    return out
