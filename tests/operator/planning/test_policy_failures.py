"""A policy's trainer failing stays that policy's, in the pure ``plan()`` on the CPU example (and its
pooled variant): the test plays the API server, the kubelet and the runtime.

What it holds: a failed trainer pod of its own is no restart of the job: it is deleted now (a
Replacing event) and created again next round in the attempt it had, while a failed coordinator or
a failed pool pod hosting a trainer still restarts the job. Status copies each policy's trainer
restarts and state from /progress; the PolicyFrozen condition names the frozen policies; the
PolicyRestarting and PolicyFrozen events are recorded once per change, not on every plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from polyrl_operator import naming
from polyrl_operator.api.progress import Progress
from polyrl_operator.observed import Child
from polyrl_operator.planning import Plan, plan
from polyrl_testenv.operator_fixtures import (
    SETTINGS,
    T0,
    children_of,
    later,
    observed,
    pod_status,
    pooled_cpu_job,
    progress,
    stored_job,
    with_status,
)

COORDINATOR = "signal-game-coordinator"
SPEAKER_TRAINER = "signal-game-speaker-trainer-0"
LISTENER_TRAINER = "signal-game-listener-trainer-0"
POOL_0 = "signal-game-pool-shared-0"
POLICY_EVENTS = {"PolicyRestarting", "PolicyFrozen"}

World = tuple[dict[str, Any], list[Child]]


def running(body: dict[str, Any], restarts: int = 0) -> World:
    """``body`` after one plan in attempt ``restarts`` (as its status recorded), every pod Running
    and ready."""
    body["status"] = {"restarts": restarts}
    first = plan(body, observed([]), SETTINGS, T0)
    return with_status(body, first), children_of(first, default_status=pod_status())


def ended(children: list[Child], name: str, phase: str = "Failed") -> list[Child]:
    failure = "container main exited 137 (OOMKilled)" if phase == "Failed" else None
    return [c if c.name != name else replace(c, phase=phase, ready=False, failure=failure) for c in children]


def _left_over(world: World, name: str) -> World:
    """``world`` with pod ``name`` labelled attempt 0: left over from before the job's restarts."""
    body, children = world

    def relabelled(c: Child) -> Child:
        labels = {**dict(c.labels), naming.LABEL_ATTEMPT: "0"}
        return replace(c, labels=tuple(labels.items()))

    return body, [relabelled(c) if c.name == name else c for c in children]


def pods(result: Plan) -> set[str]:
    return {name for kind, name in result.desired if kind == "Pod"}


def attempt_of(result: Plan, pod: str) -> str | None:
    labels: dict[str, str] = result.desired[("Pod", pod)]["metadata"]["labels"]
    return labels.get(naming.LABEL_ATTEMPT)


def reasons(result: Plan) -> set[str]:
    return {e.reason for e in result.events}


@dataclass(frozen=True)
class FailureCase:
    id: str
    world: Callable[[], World]
    """The job and its children as the failure leaves them."""
    pod: str
    """The pod that ended."""
    restarts: int
    """status.restarts after the plan."""
    events: set[str]
    """Among Restarting and Replacing: the ones recorded."""
    replaced_in: str | None
    """The attempt label of the pod created again next round; None: the pod is still wanted now."""


def _failed(body: Callable[[], dict[str, Any]], pod: str, restarts: int = 0, phase: str = "Failed") -> World:
    job, children = running(body(), restarts)
    return job, ended(children, pod, phase)


FAILURES = [
    FailureCase(
        "a failed trainer pod: replaced alone, the job does not restart",
        lambda: _failed(stored_job, SPEAKER_TRAINER),
        SPEAKER_TRAINER,
        0,
        {"Replacing"},
        "0",
    ),
    FailureCase(
        "a failed trainer pod after two restarts of the job: created again in attempt 2",
        lambda: _failed(stored_job, LISTENER_TRAINER, restarts=2),
        LISTENER_TRAINER,
        2,
        {"Replacing"},
        "2",
    ),
    FailureCase(
        "a failed coordinator restarts the job",
        lambda: _failed(stored_job, COORDINATOR),
        COORDINATOR,
        1,
        {"Restarting"},
        None,
    ),
    FailureCase(
        "a failed pool pod hosting a trainer restarts the job",
        lambda: _failed(pooled_cpu_job, POOL_0),
        POOL_0,
        1,
        {"Restarting"},
        None,
    ),
    FailureCase(
        "a failed trainer pod of an earlier attempt: the new attempt's pod replaces it, no event",
        lambda: _left_over(_failed(stored_job, SPEAKER_TRAINER, restarts=1), SPEAKER_TRAINER),
        SPEAKER_TRAINER,
        1,
        set(),
        None,
    ),
    FailureCase(
        "a trainer pod that succeeded is left as it is",
        lambda: _failed(stored_job, SPEAKER_TRAINER, phase="Succeeded"),
        SPEAKER_TRAINER,
        0,
        set(),
        None,
    ),
]


@pytest.mark.parametrize("case", FAILURES, ids=lambda c: c.id)
def test_which_failures_restart_the_job(case: FailureCase) -> None:
    body, children = case.world()
    result = plan(body, observed(children), SETTINGS, later(1))
    assert result.status is not None and result.status.restarts == case.restarts
    assert reasons(result) & {"Restarting", "Replacing"} == case.events
    if case.replaced_in is None:
        assert case.pod in pods(result)
        if "Restarting" in case.events:  # the new attempt recreates it, and the other trainers
            assert attempt_of(result, case.pod) == str(case.restarts)
            assert attempt_of(result, LISTENER_TRAINER) == str(case.restarts)
        return
    # Deleted now (not wanted), with the reason, and looked at again soon.
    assert case.pod not in pods(result)
    [why] = [e for e in result.events if e.reason == "Replacing"]
    assert why.type == "Warning" and case.pod in why.message and "OOMKilled" in why.message
    assert "restarts alone from its latest checkpoint" in why.message
    assert result.requeue_after is not None and result.requeue_after <= 1.0
    # Every other pod stays, in its attempt.
    others = {c.name for c in children if c.kind == "Pod"} - {case.pod}
    assert others <= pods(result)
    assert {attempt_of(result, name) for name in others} <= {None, case.replaced_in}
    # Next round, the pod gone: created again, in the attempt it had; still no restart.
    after = [c for c in children if c.name != case.pod]
    again = plan(with_status(body, result), observed(after), SETTINGS, later(2))
    assert case.pod in pods(again) and attempt_of(again, case.pod) == case.replaced_in
    assert again.status is not None and again.status.restarts == case.restarts
    assert not reasons(again) & {"Restarting", "Replacing"}


# -- status and events from the report -------------------------------------------------------------


def report(**policies: dict[str, Any]) -> Progress:
    """The running sample with each named policy's fields replaced (python names)."""
    sample = progress("running")
    entries = [p.model_copy(update=policies.get(p.name, {})) for p in sample.policies]
    return sample.model_copy(update={"policies": entries})


def with_policies(body: dict[str, Any], **policies: dict[str, Any]) -> dict[str, Any]:
    """``body`` whose status recorded these fields (wire names) for the named policies."""
    out = {**body, "status": {**body["status"]}}
    out["status"]["policies"] = [
        {**p, **policies.get(p["name"], {})} for p in body["status"].get("policies") or []
    ]
    return out


def _spec(**failure: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """The CPU example with these policies' failurePolicy (job-level under the key ``job``)."""

    def body() -> dict[str, Any]:
        doc = stored_job()
        spec = doc["spec"]
        spec["failurePolicy"] = {"maxRestarts": 3, **failure.get("job", {})}
        for p in spec["policies"]:
            if p["name"] in failure:
                p["failurePolicy"] = failure[p["name"]]
        return doc

    return body


@dataclass(frozen=True)
class ReportCase:
    id: str
    recorded: dict[str, dict[str, Any]]
    """What the old status recorded, per policy (wire names)."""
    reported: dict[str, dict[str, Any]] | None
    """What /progress says, per policy (python names); None: no report."""
    expect: dict[str, tuple[int, str | None]]
    """(restarts, trainerState) per policy in the new status."""
    frozen: tuple[str, str]
    """The PolicyFrozen condition's (status, reason)."""
    events: dict[str, str] = field(default_factory=dict)
    """Reason -> a part of its message, for the policy events recorded (no other)."""
    spec: Callable[[], dict[str, Any]] | None = None
    """The job (None: the CPU example with failurePolicy.maxRestarts 3)."""


TRAINING = {"restarts": 0, "trainer_state": "training"}
REPORTS = [
    ReportCase(
        "first report: copied, nothing befell",
        {},
        {"speaker": TRAINING, "listener": TRAINING},
        {"speaker": (0, "training"), "listener": (0, "training")},
        ("False", "NotFrozen"),
    ),
    ReportCase(
        "a trainer restarting alone: its count and state, one event with the limit",
        {"speaker": {"restarts": 0, "trainerState": "training"}},
        {"speaker": {"restarts": 1, "trainer_state": "restarting"}},
        {"speaker": (1, "restarting"), "listener": (0, "training")},
        ("False", "NotFrozen"),
        {"PolicyRestarting": "policy speaker: its trainer failed and restarts alone"},
    ),
    ReportCase(
        "the policy's own maxRestarts is the limit the event names",
        {"listener": {"restarts": 1, "trainerState": "training"}},
        {"listener": {"restarts": 2, "trainer_state": "restarting"}},
        {"speaker": (0, "training"), "listener": (2, "restarting")},
        ("False", "NotFrozen"),
        {"PolicyRestarting": "(restart 2 of 5)"},
        _spec(listener={"maxRestarts": 5}),
    ),
    ReportCase(
        "the same count again: no event",
        {"speaker": {"restarts": 1, "trainerState": "restarting"}},
        {"speaker": {"restarts": 1, "trainer_state": "training"}},
        {"speaker": (1, "training"), "listener": (0, "training")},
        ("False", "NotFrozen"),
    ),
    ReportCase(
        "frozen: the condition names it, one event",
        {"listener": {"restarts": 3, "trainerState": "restarting"}},
        {"listener": {"restarts": 3, "trainer_state": "frozen"}},
        {"speaker": (0, "training"), "listener": (3, "frozen")},
        ("True", "Frozen"),
        {"PolicyFrozen": "policy listener: its trainer failed past maxRestarts (3) under onPolicyFailure"},
        _spec(job={"onPolicyFailure": "freeze"}),
    ),
    ReportCase(
        "restarted and frozen in one report: both events",
        {"listener": {"restarts": 0, "trainerState": "training"}},
        {"listener": {"restarts": 1, "trainer_state": "frozen"}},
        {"speaker": (0, "training"), "listener": (1, "frozen")},
        ("True", "Frozen"),
        {"PolicyRestarting": "(restart 1 of 1)", "PolicyFrozen": "maxRestarts (1)"},
        _spec(listener={"maxRestarts": 1, "onPolicyFailure": "freeze"}),
    ),
    ReportCase(
        "still frozen: no event",
        {"listener": {"restarts": 3, "trainerState": "frozen"}},
        {"listener": {"restarts": 3, "trainer_state": "frozen"}},
        {"speaker": (0, "training"), "listener": (3, "frozen")},
        ("True", "Frozen"),
        spec=_spec(job={"onPolicyFailure": "freeze"}),
    ),
    ReportCase(
        "a new coordinator (the job restarted) counts from 0 again: no event",
        {"speaker": {"restarts": 2, "trainerState": "training"}},
        {"speaker": TRAINING},
        {"speaker": (0, "training"), "listener": (0, "training")},
        ("False", "NotFrozen"),
    ),
    ReportCase(
        "no report: as last recorded, no event",
        {"speaker": {"restarts": 2, "trainerState": "frozen"}},
        None,
        {"speaker": (2, "frozen"), "listener": (0, None)},
        ("True", "Frozen"),
        spec=_spec(job={"onPolicyFailure": "freeze"}),
    ),
]


@pytest.mark.parametrize("case", REPORTS, ids=lambda c: c.id)
def test_status_and_events_follow_each_policy_s_trainer(case: ReportCase) -> None:
    body, children = running((case.spec or _spec())())
    body = with_policies(body, **case.recorded)
    prog = report(**case.reported) if case.reported is not None else None
    result = plan(body, observed(children, prog), SETTINGS, later(1))
    assert result.status is not None
    got = {p.name: (p.restarts, p.trainer_state) for p in result.status.policies or []}
    assert got == case.expect
    [frozen] = [c for c in result.status.conditions or [] if c.type == "PolicyFrozen"]
    assert (frozen.status, frozen.reason) == case.frozen
    if frozen.status == "True":
        assert "listener" in frozen.message or "speaker" in frozen.message
    befell = [e for e in result.events if e.reason in POLICY_EVENTS]
    assert sorted(e.reason for e in befell) == sorted(case.events)
    for e in befell:
        assert e.type == "Warning" and case.events[e.reason] in e.message, e.message
    # Once per change: the next plan, on the same report, compares with the status holding it.
    again = plan(with_status(body, result), observed(children, prog), SETTINGS, later(2))
    assert not reasons(again) & POLICY_EVENTS
    assert again.status is not None and again.status.conditions == result.status.conditions


def test_the_condition_names_every_frozen_policy() -> None:
    body, children = running(_spec(job={"onPolicyFailure": "freeze"})())
    frozen = {"restarts": 3, "trainer_state": "frozen"}
    result = plan(body, observed(children, report(speaker=frozen, listener=frozen)), SETTINGS, later(1))
    assert result.status is not None
    [condition] = [c for c in result.status.conditions or [] if c.type == "PolicyFrozen"]
    assert condition.message.startswith("policies speaker, listener are frozen")
    assert sorted(e.message.split(":")[0] for e in result.events if e.reason == "PolicyFrozen") == [
        "policy listener",
        "policy speaker",
    ]


def test_a_finished_job_keeps_its_frozen_policy_on_record() -> None:
    body, children = running(_spec(job={"onPolicyFailure": "freeze"})())
    body = with_policies(body, listener={"restarts": 3, "trainerState": "frozen"})
    done = progress("done")
    entries = [p.model_copy(update={"restarts": 3, "trainer_state": "frozen"}) if p.name == "listener" else p
               for p in done.policies]  # fmt: skip
    result = plan(body, observed(children, done.model_copy(update={"policies": entries})), SETTINGS, later(1))
    assert result.status is not None and result.status.phase == "Succeeded"
    [condition] = [c for c in result.status.conditions or [] if c.type == "PolicyFrozen"]
    assert (condition.status, condition.reason) == ("True", "Frozen")
    assert not reasons(result) & POLICY_EVENTS  # recorded while it ran
