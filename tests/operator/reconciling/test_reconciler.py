"""The reconciler (``polyrl_operator.reconciling``: plan + apply + status) step by step against an
in-memory API server.

The test plays the kubelet, the runtime's /progress, Kueue and the clock; every decision of the
operator is checked as the exact objects and status it leaves behind."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from polyrl_operator import naming, pod_contract
from polyrl_operator.api import RLJobStatus
from polyrl_operator.kube import ApiError
from polyrl_testenv.operator_fixtures import SIGNAL_GAME_PODS, Sim, gpu_job, pod_status, progress, stored_job


async def running_sim(job: dict[str, Any] | None = None) -> Sim:
    sim = Sim(job or stored_job())
    await sim.step()
    sim.kubelet()
    await sim.step()
    assert sim.status["phase"] == "Running"
    return sim


async def test_first_reconcile_creates_the_exact_child_set() -> None:
    sim = Sim(stored_job())
    await sim.step()
    api = sim.api
    assert sim.job["metadata"]["finalizers"] == [naming.FINALIZER]
    assert sim.pods() == SIGNAL_GAME_PODS
    assert api.names("services") == {
        "signal-game-coordinator",
        "signal-game-workflow",
        "signal-game-speaker-rollout",
        "signal-game-speaker-trainer",
        "signal-game-listener-rollout",
        "signal-game-listener-trainer",
    }
    assert api.names("configmaps") == {"signal-game-config"}
    assert api.names("secrets") == {"signal-game-ray-token"}
    assert api.names("serviceaccounts") == {"signal-game-runtime"}
    assert api.names("networkpolicies") == {"signal-game-isolation", "signal-game-progress"}
    uid = sim.job["metadata"]["uid"]
    for (plural, _, name), obj in api.objects.items():
        if plural in ("rljobs", "events"):
            continue
        [owner] = obj["metadata"]["ownerReferences"]
        assert owner["uid"] == uid and owner["controller"] is True, name
        assert obj["metadata"]["labels"][naming.LABEL_JOB] == "signal-game"
    pod = api.obj("pods", "signal-game-speaker-trainer-0")
    assert pod["metadata"]["labels"][naming.LABEL_POLICY] == "speaker"
    assert pod["metadata"]["labels"][naming.LABEL_ROLE] == "trainer"
    assert pod["spec"]["containers"][0]["name"] == "main"
    status = sim.status
    assert status["observedGeneration"] == 1
    assert status["phase"] == "Pending"
    reasons = [e["reason"] for (pl, _, _), e in api.objects.items() if pl == "events"]
    assert "CreatedPods" in reasons


async def test_an_unchanged_job_costs_no_write() -> None:
    sim = await running_sim()
    before = sim.api.writes
    for _ in range(3):
        await sim.step(30)
    assert sim.api.writes == before


async def test_ready_pods_make_the_job_running_and_transition_times_hold() -> None:
    sim = Sim(stored_job())
    await sim.step()
    ready_before = sim.condition("Ready")
    assert ready_before["status"] == "False"
    sim.kubelet()
    await sim.step(5)
    ready = sim.condition("Ready")
    assert ready["status"] == "True" and ready["reason"] == "PodsReady"
    assert ready["lastTransitionTime"] != ready_before["lastTransitionTime"]
    assert sim.condition("Suspended")["lastTransitionTime"] == ready_before["lastTransitionTime"]
    await sim.step(60)
    assert sim.condition("Ready")["lastTransitionTime"] == ready["lastTransitionTime"]
    assert {p["name"]: (p["rollout"], p["trainer"]) for p in sim.status["policies"]} == {
        "speaker": ({"desired": 1, "ready": 1}, {"desired": 1, "ready": 1}),
        "listener": ({"desired": 1, "ready": 1}, {"desired": 1, "ready": 1}),
    }


async def test_backlog_scales_out_into_status_never_spec() -> None:
    sim = await running_sim()
    spec = copy.deepcopy(sim.job["spec"])
    sim.progress = progress("running")
    await sim.step()
    speaker = next(p for p in sim.status["policies"] if p["name"] == "speaker")
    assert speaker["rollout"]["desired"] == 2  # ceil(9 / 4) = 3, capped at max 2
    assert speaker["version"] == 12 and speaker["rewardMean"] == 0.41 and speaker["lastCheckpointStep"] == 10
    assert "signal-game-speaker-rollout-1" in sim.pods()
    assert sim.job["spec"] == spec and sim.job["metadata"]["generation"] == 1
    scaled = [e for (pl, _, _), e in sim.api.objects.items() if pl == "events" and e["reason"] == "Scaled"]
    assert len(scaled) == 1 and "speaker: 1 -> 2" in scaled[0]["message"]


async def test_scale_in_drains_the_highest_index_before_deleting_it() -> None:
    sim = await running_sim()
    sim.progress = progress("running")
    await sim.step()
    sim.kubelet()
    await sim.step()
    sim.progress = progress("idle")
    await sim.step()
    victim = sim.api.obj("pods", "signal-game-speaker-rollout-1")
    assert victim["metadata"]["annotations"][pod_contract.ANNOTATION_DRAIN] == "true"
    assert "signal-game-speaker-rollout-1" in sim.pods()
    await sim.step()  # not drained yet: still there
    assert "signal-game-speaker-rollout-1" in sim.pods()
    sim.progress = progress("draining")
    await sim.step()
    assert "signal-game-speaker-rollout-1" not in sim.pods()
    assert "signal-game-speaker-rollout-0" in sim.pods()


async def test_drain_times_out() -> None:
    sim = await running_sim()
    sim.progress = progress("running")
    await sim.step()
    sim.kubelet()
    await sim.step()
    sim.progress = progress("idle")
    await sim.step()
    assert "signal-game-speaker-rollout-1" in sim.pods()
    await sim.step(sim.settings.drain_timeout + 1)
    assert "signal-game-speaker-rollout-1" not in sim.pods()


async def test_failed_rollout_pod_is_replaced_without_a_restart() -> None:
    sim = await running_sim()
    sim.api.set_pod_status("signal-game-listener-rollout-0", pod_status("Failed"))
    await sim.step()
    assert "signal-game-listener-rollout-0" not in sim.pods()
    await sim.step()
    assert "signal-game-listener-rollout-0" in sim.pods()
    assert sim.status["restarts"] == 0


def events(sim: Sim, reason: str) -> list[dict[str, Any]]:
    return [e for (pl, _, _), e in sim.api.objects.items() if pl == "events" and e["reason"] == reason]


async def test_coordinator_failure_restarts_training_roles_and_counts_once() -> None:
    sim = await running_sim()
    rollout_uid = sim.api.obj("pods", "signal-game-speaker-rollout-0")["metadata"]["uid"]
    sim.api.set_pod_status("signal-game-coordinator", pod_status("Failed"))
    await sim.step()
    assert sim.status["restarts"] == 1
    # Stale view (as after a kill between the status write and the deletes): no second count.
    await sim.step()
    await sim.step()
    assert sim.status["restarts"] == 1
    for name in (
        "signal-game-coordinator",
        "signal-game-speaker-trainer-0",
        "signal-game-listener-trainer-0",
    ):
        assert sim.api.obj("pods", name)["metadata"]["labels"][naming.LABEL_ATTEMPT] == "1"
    assert sim.api.obj("pods", "signal-game-speaker-rollout-0")["metadata"]["uid"] == rollout_uid
    assert sim.pods() == SIGNAL_GAME_PODS


async def test_a_failed_trainer_pod_is_replaced_alone_in_its_attempt() -> None:
    """The runtime restarts that policy's trainer by itself: the operator only gives it its pod back,
    in the attempt it had (a later restart of the job recreates it like the other trainers)."""
    sim = await running_sim()
    sim.api.set_pod_status("signal-game-coordinator", pod_status("Failed"))
    await sim.converge(3)
    sim.kubelet()
    await sim.step()
    assert sim.status["restarts"] == 1
    others = {
        name: sim.api.obj("pods", name)["metadata"]["uid"]
        for name in SIGNAL_GAME_PODS - {"signal-game-listener-trainer-0"}
    }

    sim.api.set_pod_status("signal-game-listener-trainer-0", pod_status("Failed"))
    await sim.step()
    assert "signal-game-listener-trainer-0" not in sim.pods()
    [replacing] = events(sim, "Replacing")
    assert "the trainer of policy listener restarts alone" in replacing["message"]
    await sim.step()
    trainer = sim.api.obj("pods", "signal-game-listener-trainer-0")
    assert trainer["metadata"]["labels"][naming.LABEL_ATTEMPT] == "1"
    assert sim.status["restarts"] == 1 and len(events(sim, "Restarting")) == 1
    assert {name: sim.api.obj("pods", name)["metadata"]["uid"] for name in others} == others
    assert sim.pods() == SIGNAL_GAME_PODS


async def test_a_failed_report_restarts_once_and_the_old_coordinator_is_not_counted_again() -> None:
    """The failed coordinator keeps answering /progress ("failed", attempt 0) while its pod is
    deleted, and the new attempt's coordinator pod already exists: read as the new attempt's, that
    document restarted the job a second time within a second (CI). Only attempt 1's own report counts."""
    sim = await running_sim()
    sim.progress = progress("failed-retryable")
    await sim.step()
    assert sim.status["restarts"] == 1
    restarting = events(sim, "Restarting")
    assert len(restarting) == 1 and "no live engine for policy 'speaker'" in restarting[0]["message"]
    await sim.converge(2)  # the attempt-1 pods are created; the old coordinator still answers
    sim.kubelet()
    await sim.converge(2)
    assert sim.status["restarts"] == 1 and sim.status["phase"] == "Running"
    sim.progress = progress("failed-retryable", **{'"attempt": 0': '"attempt": 1'})
    await sim.step()
    assert sim.status["restarts"] == 2


async def test_restart_limit_fails_the_job_and_frees_the_pods() -> None:
    job = stored_job()
    job["spec"]["failurePolicy"] = {"maxRestarts": 1}
    sim = await running_sim(job)
    sim.api.set_pod_status("signal-game-coordinator", pod_status("Failed"))
    await sim.converge(3)
    assert sim.status["restarts"] == 1
    sim.kubelet()
    await sim.step()
    sim.api.set_pod_status("signal-game-coordinator", pod_status("Failed"))
    await sim.step()
    assert sim.status["phase"] == "Failed"
    failed = sim.condition("Failed")
    assert failed["status"] == "True" and failed["reason"] == "RestartLimitExceeded"
    assert "signal-game-coordinator" in failed["message"]
    assert sim.pods() == {"signal-game-coordinator"}  # kept for its logs; the rest freed
    assert "completionTime" in sim.status


async def test_suspend_checkpoints_then_deletes_pods_and_resume_recreates() -> None:
    sim = await running_sim()
    sim.progress = progress("idle")
    sim.patch_spec({"suspend": True})
    await sim.step()
    coordinator = sim.api.obj("pods", "signal-game-coordinator")
    request = coordinator["metadata"]["annotations"][pod_contract.ANNOTATION_CHECKPOINT_REQUEST]
    assert sim.pods() == SIGNAL_GAME_PODS  # waiting for the checkpoint
    assert sim.status["phase"] == "Suspended"
    assert sim.condition("Suspended")["status"] == "False"
    await sim.step()
    assert sim.pods() == SIGNAL_GAME_PODS
    sim.progress = progress("checkpointed", REQUEST=request)
    await sim.step()
    assert sim.pods() == set()
    await sim.step()
    assert sim.condition("Suspended")["status"] == "True"
    assert sim.status["policies"][0]["lastCheckpointStep"] == 40  # status kept
    sim.progress = None
    sim.patch_spec({"suspend": False})
    await sim.step()
    assert sim.pods() == SIGNAL_GAME_PODS
    assert sim.condition("Suspended")["reason"] == "Resumed"


async def test_suspend_without_checkpoint_answer_times_out() -> None:
    sim = await running_sim()
    sim.patch_spec({"suspend": True})
    await sim.step()
    assert sim.pods() == SIGNAL_GAME_PODS
    await sim.step(sim.settings.checkpoint_timeout + 1)
    assert sim.pods() == set()


async def test_the_deadline_checkpoints_then_fails_the_job_and_survives_a_restart() -> None:
    job = stored_job()
    job["spec"]["activeDeadlineSeconds"] = 120
    sim = await running_sim(job)
    started = sim.status["startTime"]
    sim.progress = progress("idle")
    await sim.step(60)
    assert sim.status["phase"] == "Running"
    # A restart of the training roles does not reset the clock: startTime stays.
    sim.api.set_pod_status("signal-game-coordinator", pod_status("Failed"), "team-a")
    await sim.step()
    assert sim.status["restarts"] == 1 and sim.status["startTime"] == started
    await sim.converge(2)
    sim.kubelet()
    await sim.step()
    sim.progress = progress("idle").model_copy(update={"attempt": 1})
    await sim.step(60)
    coordinator = sim.api.obj("pods", "signal-game-coordinator")
    request = coordinator["metadata"]["annotations"][pod_contract.ANNOTATION_CHECKPOINT_REQUEST]
    assert request.startswith("deadlineexceeded-")
    assert sim.pods() == SIGNAL_GAME_PODS  # kept until the checkpoint is done
    assert sim.condition("Progressing")["reason"] == "DeadlineExceeded"
    assert sim.status["phase"] == "Running"
    sim.progress = progress("checkpointed", REQUEST=request).model_copy(update={"attempt": 1})
    await sim.step()
    assert sim.status["phase"] == "Failed"
    failed = sim.condition("Failed")
    assert failed["status"] == "True" and failed["reason"] == "DeadlineExceeded"
    assert "activeDeadlineSeconds (120s" in failed["message"]
    assert sim.pods() == set()
    reasons = [e["reason"] for (pl, _, _), e in sim.api.objects.items() if pl == "events"]
    assert {"CheckpointRequested", "Checkpointed", "DeadlineExceeded"} <= set(reasons)
    await sim.step(600)
    assert sim.status["phase"] == "Failed" and sim.pods() == set()


async def test_done_succeeds_frees_workers_and_ttl_deletes_the_job() -> None:
    job = stored_job()
    job["spec"]["ttlSecondsAfterFinished"] = 600
    sim = await running_sim(job)
    sim.progress = progress("done")
    await sim.step()
    assert sim.status["phase"] == "Succeeded"
    assert sim.condition("Succeeded")["status"] == "True"
    assert sim.pods() == {"signal-game-coordinator"}  # kept for its logs
    await sim.step(300)
    assert ("rljobs", "team-a", "signal-game") in sim.api.objects
    await sim.step(301)
    assert sim.job["metadata"].get("deletionTimestamp")  # TTL: deleted; the finalizer cleans up
    await sim.converge(2)
    assert ("rljobs", "team-a", "signal-game") not in sim.api.objects
    assert sim.pods() == set() and sim.api.names("services") == set()


async def test_fatal_runtime_failure_fails_without_restart() -> None:
    sim = await running_sim()
    sim.progress = progress("failed-fatal")
    await sim.step()
    assert sim.status["phase"] == "Failed"
    assert sim.condition("Failed")["reason"] == "RuntimeFailed"
    assert "SignalGam" in sim.condition("Failed")["message"]
    assert sim.status["restarts"] == 0


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (
            lambda s: s["policies"][1]["rollout"].__setitem__(
                "podTemplate", {"metadata": {"labels": {"polyrl.dev/role": "x"}}}
            ),
            "spec.policies[1].rollout.podTemplate.metadata.labels",
        ),
        (
            lambda s: s["workflow"].__setitem__("podTemplate", {"spec": {"restartPolicy": "Always"}}),
            "spec.workflow.podTemplate.spec.restartPolicy",
        ),
    ],
)
async def test_invalid_spec_fails_naming_the_field_and_stays_quiet(mutate: Any, field: str) -> None:
    job = stored_job()
    mutate(job["spec"])
    sim = Sim(job)
    await sim.step()
    assert sim.status["phase"] == "Failed"
    failed = sim.condition("Failed")
    assert failed["reason"] == "InvalidSpec" and field in failed["message"]
    assert sim.pods() == set()
    writes = sim.api.writes
    await sim.converge(3)
    assert sim.api.writes == writes
    # Fixing the spec (a new generation) brings the job back.
    sim.replace_spec(stored_job()["spec"])
    await sim.step()
    assert sim.status["phase"] == "Pending" and sim.pods() == SIGNAL_GAME_PODS


async def test_invalid_spec_quoting_a_huge_value_still_fits_the_status() -> None:
    # The CRD passes podTemplate.spec through, so a 40 KB restartPolicy reaches the operator, whose
    # message quotes it. The CRD caps status.message and condition messages at 32768 characters:
    # a longer one made every status write fail (422) and the job never showed why (found while
    # fuzzing, tests/e2e/test_fuzzed_rljobs.py).
    job = stored_job()
    job["spec"]["workflow"]["podTemplate"] = {"spec": {"restartPolicy": "x" * 40_000}}
    sim = Sim(job)
    await sim.step()
    RLJobStatus.model_validate(sim.status)  # the status schema the CRD is generated from
    assert sim.status["phase"] == "Failed"
    assert sim.status["message"].startswith("invalid spec: spec.workflow.podTemplate.spec.restartPolicy: ")
    failed = sim.condition("Failed")
    assert failed["reason"] == "InvalidSpec" and failed["message"].endswith("characters, truncated)")
    writes = sim.api.writes  # the same (cut) message next time: no new status, no new event
    await sim.converge(3)
    assert sim.api.writes == writes


async def test_a_child_the_api_server_refuses_makes_the_spec_invalid_instead_of_a_retry_loop() -> None:
    # podTemplate.spec passes the CRD as free-form, so a nodeSelector value of the wrong type reaches
    # the operator and the API server refuses the pod (422). No retry can fix that: the job goes
    # InvalidSpec naming what was refused, its children go, and nothing is retried until the spec
    # changes (found by tests/e2e/test_fuzzed_rljobs.py: a refused Workload was retried forever).
    job = stored_job()
    job["spec"]["workflow"]["podTemplate"] = {"spec": {"nodeSelector": {"zone": 7}}}
    sim = Sim(job)
    create = sim.api._create

    def validating_create(plural: str, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        if plural == "pods" and 7 in (body["spec"].get("nodeSelector") or {}).values():
            name = body["metadata"]["name"]
            raise ApiError(
                422, "Invalid", f'Pod "{name}" is invalid: spec.nodeSelector.zone: must be a string'
            )
        return create(plural, namespace, body)

    sim.api._create = validating_create  # type: ignore[method-assign]
    await sim.converge(3)
    failed = sim.condition("Failed")
    assert sim.status["phase"] == "Failed" and failed["reason"] == "InvalidSpec"
    assert "refused Pod signal-game-workflow-0" in failed["message"]
    assert "spec.nodeSelector.zone" in failed["message"]
    assert sim.pods() == set()  # what the refused pass created is gone
    writes = sim.api.writes
    await sim.converge(3)
    assert sim.api.writes == writes
    sim.replace_spec(stored_job()["spec"])  # a new spec is tried
    await sim.step()
    assert sim.status["phase"] == "Pending" and sim.pods() == SIGNAL_GAME_PODS


async def test_quota_refusal_rolls_the_job_back_and_retries() -> None:
    sim = Sim(stored_job())
    sim.api.pod_quota = 4
    await sim.step()
    assert sim.pods() == set()  # never half a job
    assert 0.0 in sim.kicks  # the next plan, at once, reports the refusal in the status
    reasons = [e["reason"] for (pl, _, _), e in sim.api.objects.items() if pl == "events"]
    assert "QuotaExceeded" in reasons
    await sim.step(0)
    quota = sim.condition("QuotaExceeded")
    assert quota["status"] == "True" and "exceeded quota" in quota["message"]
    assert sim.status["phase"] == "Pending"
    creates = sim.api.requests["create"]
    await sim.step(1)  # inside the backoff: nothing is tried
    assert sim.api.requests["create"] == creates and sim.pods() == set()
    sim.api.pod_quota = None
    await sim.step(sim.settings.quota_backoff + 1)
    assert sim.pods() == SIGNAL_GAME_PODS
    await sim.step()
    assert sim.condition("QuotaExceeded")["status"] == "False"


async def test_kueue_workload_gates_pods_and_admission_places_them() -> None:
    job = gpu_job()
    sim = Sim(job)
    # The class the example's scheduling.priorityClassName names (Kueue's, cluster-scoped).
    sim.api._create("workloadpriorityclasses", None, {"metadata": {"name": "rl-batch"}, "value": 100})
    await sim.step()
    assert sim.api.names("workloads") == {"debate"}
    assert sim.pods() == set()
    workload = sim.api.obj("workloads", "debate")
    podsets = {p["name"]: p["count"] for p in workload["spec"]["podSets"]}
    assert podsets == {
        "coordinator": 1,
        "workflow": 8,
        "proposer-rollout": 8,
        "proposer-trainer": 2,
        "critic-rollout": 4,
        "critic-trainer": 1,
        "judge-rollout": 2,
        "judge-trainer": 1,
    }
    assert workload["spec"]["queueName"] == "team-a" and workload["spec"]["active"] is True
    assert sim.condition("Admitted")["status"] == "False"
    sim.api._create(
        "resourceflavors",
        None,
        {"metadata": {"name": "h100-spot"}, "spec": {"nodeLabels": {"pool": "h100-spot"}}},
    )
    workload["status"] = {
        "admission": {
            "clusterQueue": "gpus",
            "podSetAssignments": [
                {
                    "name": ps,
                    "count": n,
                    "flavors": {"nvidia.com/gpu": "h100-spot"} if "trainer" in ps else {},
                }
                for ps, n in podsets.items()
            ],
        },
        "conditions": [{"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True"}],
    }
    await sim.step()
    assert sim.condition("Admitted")["status"] == "True"
    assert len(sim.pods()) == 11
    trainer = sim.api.obj("pods", "debate-proposer-trainer-0")
    assert trainer["spec"]["nodeSelector"] == {"polyrl.dev/gpu-type": "h100", "pool": "h100-spot"}
    assert trainer["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    # Eviction: pods go (no coordinator running, nothing to checkpoint), the job shows Suspended.
    workload["status"]["conditions"].append({"type": "Evicted", "status": "True", "message": "preempted"})
    await sim.step()
    await sim.step()
    assert sim.pods() == set()
    assert sim.status["phase"] == "Suspended" and sim.condition("Suspended")["reason"] == "Evicted"
    sim.patch_spec({"suspend": True})
    await sim.step()
    assert sim.api.obj("workloads", "debate")["spec"]["active"] is False


async def test_delete_removes_every_child_then_the_finalizer() -> None:
    sim = await running_sim()
    key = ("rljobs", "team-a", "signal-game")
    sim.api._delete(key, sim.api.objects[key])
    await sim.step()
    assert sim.pods() == set() and sim.api.names("services") == set()
    await sim.step()
    assert key not in sim.api.objects


async def test_children_of_an_older_job_with_the_same_name_are_replaced() -> None:
    sim = await running_sim()
    old = sim.api.obj("pods", "signal-game-workflow-0")
    old["metadata"]["ownerReferences"][0]["uid"] = "an-earlier-incarnation"
    await sim.step()
    assert "signal-game-workflow-0" not in sim.pods()
    await sim.step()
    assert (
        sim.api.obj("pods", "signal-game-workflow-0")["metadata"]["ownerReferences"][0]["uid"]
        == sim.job["metadata"]["uid"]
    )


async def test_secret_token_is_stable_across_reconciles() -> None:
    sim = await running_sim()
    token = sim.api.obj("secrets", "signal-game-ray-token")["data"]
    sim.patch_spec({"training": {"totalSteps": 61, "episodesPerStep": 32, "seed": 7}})
    await sim.converge(3)
    assert sim.api.obj("secrets", "signal-game-ray-token")["data"] == token
    assert '"totalSteps": 61' in sim.api.obj("configmaps", "signal-game-config")["data"]["rljob.json"]


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
