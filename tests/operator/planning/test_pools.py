"""Plans of a job with a device pool: the pure ``plan()`` on the CPU example whose pool ``shared``
(1 to 3 pods) hosts the speaker's rollout and trainer and the listener's rollout, the listener's
trainer keeping a pod of its own. The test plays the API server, the kubelet and the runtime.

What it holds: the pool's pods replace the pooled roles' own; the pool scales on the backlog of all
the rollouts placed on it, drains a pod before deleting it (every engine on it drained); a failed
pool pod that hosts a trainer restarts the job, one past replicas.min is replaced alone; status
reports each pool, counts each pooled role on its pool's pods and shows the busy fraction and
switches the coordinator reports.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from polyrl_operator import naming
from polyrl_operator.api.progress import Progress
from polyrl_operator.observed import Child
from polyrl_operator.planning import Plan, plan
from polyrl_operator.pod_contract import ANNOTATION_DRAIN
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

POOL_0, POOL_1 = "signal-game-pool-shared-0", "signal-game-pool-shared-1"
ROLES = ["speaker/rollout", "speaker/trainer", "listener/rollout"]
World = tuple[dict[str, Any], list[Child]]


def running(pool_desired: int | None = None) -> World:
    """The pooled job after one plan, every pod Running and ready (``pool_desired``: the pool's
    count the status recorded, as after an earlier scale-out)."""
    body = pooled_cpu_job()
    if pool_desired is not None:
        body["status"] = {"pools": [{"name": "shared", "desired": pool_desired}]}
    first = plan(body, observed([]), SETTINGS, T0)
    return with_status(body, first), children_of(first, default_status=pod_status())


def report(backlog: tuple[int, int], engines: dict[str, dict[str, Any]]) -> Progress:
    """/progress with the speaker's and the listener's backlog and, per pool pod, how each of the
    two engines on it reports (the same for both unless ``engines`` names a policy)."""

    def worker(pod: str, policy: str) -> dict[str, Any]:
        state = engines[pod]
        return {"pod": pod, **state.get(policy, state.get("both", {}))}

    return Progress.model_validate(
        {
            "state": "running",
            "policies": [
                {"name": name, "backlog": backlog[i], "engines": [worker(pod, name) for pod in engines]}
                for i, name in enumerate(("speaker", "listener"))
            ],
        }
    )


def failed(children: list[Child], name: str) -> list[Child]:
    return [
        c if c.name != name else replace(c, phase="Failed", ready=False, failure="OOMKilled")
        for c in children
    ]


def pods(result: Plan) -> set[str]:
    return {name for kind, name in result.desired if kind == "Pod"}


def reasons(result: Plan) -> set[str]:
    return {e.reason for e in result.events}


def test_the_pool_s_pods_replace_the_pooled_roles_own() -> None:
    result = plan(pooled_cpu_job(), observed([]), SETTINGS, T0)
    assert pods(result) == {
        "signal-game-coordinator",
        "signal-game-workflow-0",
        "signal-game-listener-trainer-0",
        POOL_0,
    }
    services = {name for kind, name in result.desired if kind == "Service"}
    assert services == {
        "signal-game-coordinator",
        "signal-game-workflow",
        "signal-game-listener-trainer",
        "signal-game-pool-shared",
    }
    assert result.status is not None
    status = result.status.to_k8s()
    assert status["pools"] == [{"name": "shared", "desired": 1, "ready": 0, "roles": ROLES}]
    assert status["poolSummary"] == "shared:0/1"
    speaker, listener = status["policies"]
    assert speaker["rollout"] == speaker["trainer"] == {"desired": 1, "ready": 0, "pool": "shared"}
    assert listener["rollout"] == {"desired": 1, "ready": 0, "pool": "shared"}
    assert listener["trainer"] == {"desired": 1, "ready": 0}


def test_a_job_without_pools_reports_none() -> None:
    result = plan(stored_job(), observed([]), SETTINGS, T0)
    assert result.status is not None
    status = result.status.to_k8s()
    assert "pools" not in status and "poolSummary" not in status
    assert status["policies"][0]["rollout"] == {"desired": 1, "ready": 0}


def test_ready_pool_pods_count_for_every_role_placed_on_them() -> None:
    body, children = running()
    result = plan(body, observed(children), SETTINGS, later(1))
    assert result.status is not None
    status = result.status.to_k8s()
    assert status["phase"] == "Running"
    assert (status["pools"][0]["ready"], status["poolSummary"]) == (1, "shared:1/1")
    assert status["policies"][0]["trainer"] == {"desired": 1, "ready": 1, "pool": "shared"}


def test_status_shows_the_pool_s_busy_fraction_and_switches_from_the_report() -> None:
    body, children = running()
    result = plan(body, observed(children, progress("pooled")), SETTINGS, later(1))
    assert result.status is not None
    [shared] = result.status.to_k8s()["pools"]
    assert (shared["busyFraction"], shared["switches"]) == (0.87, 16)
    assert result.status.pool_summary == "shared:1/1"  # the column shows pods only

    # A reconcile without a report keeps what the last one said.
    again = plan(with_status(body, result), observed(children), SETTINGS, later(2))
    assert again.status is not None
    [kept] = again.status.to_k8s()["pools"]
    assert (kept["busyFraction"], kept["switches"]) == (0.87, 16)


def test_the_pool_scales_out_on_the_backlog_of_all_its_rollouts() -> None:
    """3 requests wait for each policy: neither alone is above 4 per pod, together they are."""
    body, children = running()
    result = plan(body, observed(children, report((3, 3), {POOL_0: {}})), SETTINGS, later(1))
    assert result.scaled == (("shared", "pool", 1, 2),)
    [scaled] = [e.message for e in result.events if e.reason == "Scaled"]
    assert scaled.startswith("pool shared: 1 -> 2 replicas (backlog 6 ")
    assert POOL_1 in pods(result)
    assert result.status is not None
    status = result.status.to_k8s()
    assert status["pools"][0]["desired"] == 2
    speaker = status["policies"][0]
    assert speaker["rollout"]["desired"] == 2  # one engine on each pool pod
    assert speaker["trainer"]["desired"] == 1  # ranks on the first replicas.min pods only


def test_the_pool_drains_a_pod_before_deleting_it() -> None:
    body, children = running(pool_desired=2)
    idle = {"both": {"utilisation": 0.0}}
    result = plan(body, observed(children, report((0, 0), {POOL_0: idle, POOL_1: idle})), SETTINGS, later(1))
    assert result.scaled == (("shared", "pool", 2, 1),)
    assert POOL_1 not in pods(result) and ("Pod", POOL_1) in result.keep
    assert result.annotate[POOL_1][ANNOTATION_DRAIN] == "true"
    assert "Draining" in reasons(result)

    # The pod goes once every engine on it is drained, not before.
    body = with_status(body, result)
    draining = [
        c if c.name != POOL_1 else replace(c, annotations=((ANNOTATION_DRAIN, "true"),)) for c in children
    ]
    half = {"speaker": {"draining": True, "drained": True}, "listener": {"draining": True}}
    one_left = plan(
        body, observed(draining, report((0, 0), {POOL_0: idle, POOL_1: half})), SETTINGS, later(2)
    )
    assert ("Pod", POOL_1) in one_left.keep and "Drained" not in reasons(one_left)
    done = {"both": {"draining": True, "drained": True}}
    drained = plan(body, observed(draining, report((0, 0), {POOL_0: idle, POOL_1: done})), SETTINGS, later(3))
    assert ("Pod", POOL_1) not in drained.keep and "Drained" in reasons(drained)


def test_a_failed_pool_pod_hosting_a_trainer_restarts_the_job() -> None:
    body, children = running(pool_desired=2)
    result = plan(body, observed(failed(children, POOL_0)), SETTINGS, later(1))
    assert "Restarting" in reasons(result)
    assert result.status is not None and result.status.restarts == 1
    assert result.desired[("Pod", POOL_0)]["metadata"]["labels"][naming.LABEL_ATTEMPT] == "1"
    assert naming.LABEL_ATTEMPT not in result.desired[("Pod", POOL_1)]["metadata"]["labels"]


def test_a_failed_pool_pod_past_the_minimum_is_replaced_alone() -> None:
    body, children = running(pool_desired=2)
    result = plan(body, observed(failed(children, POOL_1)), SETTINGS, later(1))
    assert "Replacing" in reasons(result) and "Restarting" not in reasons(result)
    assert result.status is not None and result.status.restarts == 0
    assert POOL_1 not in pods(result)  # deleted now, created again by the next plan


def test_kueue_admitting_fewer_pool_pods_caps_the_pool() -> None:
    body, children = running()
    body["spec"]["scheduling"] = {"queueName": "team-a"}
    workload = Child(
        kind="Workload",
        name="signal-game",
        namespace="team-a",
        job="signal-game",
        owner_uid=body["metadata"]["uid"],
        workload_status={
            "admission": {"clusterQueue": "cq", "podSetAssignments": [{"name": "shared-pool", "count": 2}]},
            "conditions": [{"type": "Admitted", "status": "True"}],
        },
    )
    busy = report((20, 20), {POOL_0: {"both": {"utilisation": 1.0}}})
    result = plan(body, observed([*children, workload], busy), SETTINGS, later(1))
    assert result.scaled == (("shared", "pool", 1, 2),)
    podsets = next(m for (kind, _), m in result.desired.items() if kind == "Workload")["spec"]["podSets"]
    assert [(p["name"], p["count"]) for p in podsets][-1] == ("shared-pool", 3)
