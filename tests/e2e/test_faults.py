"""Scenarios 2-6: scaling out and in, a trainer crash, an operator restart, suspend/resume and a coordinator
that keeps crashing, each on a running 4-pod job (tests/e2e/data/selfplay-e2e.yaml) whose pods run
the real runtime. The coordinator's final counters prove that no sample was lost or trained twice."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest

from .conftest import E2E, accounted, selfplay

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

JOB = "selfplay"
STEPS, EPISODES, SAMPLES_PER_EPISODE = 16, 8, 2  # the agent plays both sides: two samples each
LONG = 40  # steps of the jobs that must still run while the test acts on them
LATENCY_S = 1.0  # seconds each episode waits on its environment (see job())


def job(steps: int = STEPS) -> dict[str, Any]:
    """The selfplay job whose episodes wait LATENCY_S on their environment. Without it a step takes
    ~40 ms and, on a loaded machine, a job can end before the operator has acted on it; with it, as
    episodes of at most maxStaleness + 1 = 2 versions are in flight, a step takes at least
    LATENCY_S / 2 (LONG steps: at least 20 s)."""
    doc = selfplay(training={"totalSteps": steps, "episodesPerStep": EPISODES, "seed": 3})
    doc["spec"]["workflow"]["args"]["latency_s"] = LATENCY_S
    return doc


def trained_exactly_once(counters: dict[str, Any], steps: int = STEPS) -> None:
    """Each step trains one full batch: the acknowledged samples of the surviving timeline are exactly
    steps x batch, so nothing acknowledged was trained twice (a replay would add) or lost."""
    accounted(counters)
    assert counters["steps"] == {"agent": steps}
    assert counters["buffers"]["agent"]["consumed"] == steps * EPISODES * SAMPLES_PER_EPISODE, counters


def test_raising_min_adds_a_rollout_that_joins_at_the_current_version(e2e: E2E, namespace: str) -> None:
    e2e.start_operator(autoscale={"backlogHigh": 1e9, "utilisationLow": 0})
    # far longer than the test: training must still be going when the new node has joined
    e2e.apply(job(50 * LONG), namespace)  # rollout replicas min 1, max 2: one engine to begin with
    e2e.eventually(lambda: e2e.step(JOB, namespace) >= 3, timeout=240, what="step 3 on one engine")
    joined_at = e2e.step(JOB, namespace)
    replicas = "/spec/policies/0/rollout/replicas"
    e2e.kubectl("patch", "rljob", JOB, "-n", namespace, "--type=json", "-p",
                json.dumps([{"op": "replace", "path": replicas, "value": {"min": 2, "max": 2}}]))  # fmt: skip
    new = f"{JOB}-agent-rollout-1"
    seen: list[dict[str, Any]] = []

    def serving() -> bool:
        doc = e2e.progress(JOB, namespace)
        if doc is None or not doc["policies"]:  # no policies listed while the coordinator starts
            return False
        engine = next((e for e in doc["policies"][0]["engines"] if e["pod"] == new), None)
        if engine is not None:
            seen.append({**engine, "policyVersion": doc["policies"][0]["version"]})
        # it caught up before it got work: a version at least the one training was at when it was asked
        # for, and it has spent time generating since
        return engine is not None and engine["version"] >= joined_at and engine["utilisation"] > 0

    e2e.eventually(
        serving, timeout=300, what=lambda: f"{new} serving; seen {seen[-3:]}\n{e2e.kubelet.logs()[-4000:]}"
    )
    # whenever it was generating, it held weights at least as new as when it was asked for
    assert all(e["version"] >= joined_at for e in seen if e["utilisation"] > 0 or e["inFlight"]), seen
    # and training goes on with both engines: the policy moves on from the version it joined at
    version = seen[-1]["policyVersion"]
    e2e.eventually(lambda: e2e.step(JOB, namespace) >= version + 3, timeout=120, what="training on")
    assert not e2e.kubelet.errors


def test_lowering_max_drains_a_rollout_and_deletes_it_without_loss(e2e: E2E, namespace: str) -> None:
    # only the spec's bounds move replicas here: no autoscaling on backlog or utilisation
    e2e.start_operator(autoscale={"backlogHigh": 1e9, "utilisationLow": 0})
    doc = job(LONG)
    doc["spec"]["policies"][0]["rollout"]["replicas"] = {"min": 2, "max": 2}
    e2e.apply(doc, namespace)
    gone = f"{JOB}-agent-rollout-1"

    def both_serving() -> bool:
        doc = e2e.progress(JOB, namespace)
        if doc is None or not doc["policies"]:  # no policies listed while the coordinator starts
            return False
        engines = {e["pod"]: e for e in doc["policies"][0]["engines"]}
        return doc["policies"][0]["step"] >= 3 and {f"{JOB}-agent-rollout-0", gone} <= set(engines)

    e2e.eventually(both_serving, timeout=240, what="two engines serving by step 3")
    replicas = "/spec/policies/0/rollout/replicas"
    e2e.kubectl("patch", "rljob", JOB, "-n", namespace, "--type=json", "-p",
                json.dumps([{"op": "replace", "path": replicas, "value": {"min": 1, "max": 1}}]))  # fmt: skip
    drained: list[bool] = []

    def deleted() -> bool:
        doc = e2e.progress(JOB, namespace) or {"policies": []}
        for policy in doc["policies"][:1]:
            drained.extend(e["drained"] for e in policy["engines"] if e["pod"] == gone)
        return gone not in e2e.pods(namespace)

    e2e.eventually(deleted, timeout=180, what=f"{gone} drained and deleted")

    def drain_events() -> list[str]:
        return [reason for reason, message in e2e.events(namespace) if gone in message]

    # It was deleted because /progress reported it drained, not after the drain timeout. The operator's
    # event says so; polling /progress (`drained`) can miss a drained state the operator acted on
    # within the poll's half second.
    e2e.eventually(
        lambda: "Drained" in drain_events(),
        timeout=60,
        what=lambda: f"a Drained event for {gone}; events {drain_events()}, /progress drained {drained}",
    )
    assert "DrainTimeout" not in drain_events()
    e2e.wait(JOB, namespace, "Succeeded", timeout=400)
    trained_exactly_once(e2e.counters(JOB, namespace), LONG)  # no episode lost to the drain


def two_policies() -> dict[str, Any]:
    """The selfplay job with each side of the game its own policy (6 pods)."""
    doc = job()
    agent = doc["spec"]["policies"][0]
    agent["rollout"]["replicas"] = {"min": 1, "max": 1}
    doc["spec"]["policies"] = [{**agent, "name": "speaker"}, {**agent, "name": "listener"}]
    doc["spec"]["workflow"]["args"]["policies"] = {"speaker": "speaker", "listener": "listener"}
    return doc


def test_a_trainer_crash_restarts_that_policys_trainer_alone(e2e: E2E, namespace: str) -> None:
    e2e.start_operator()
    e2e.apply(two_policies(), namespace)
    seen: list[dict[str, Any]] = []  # (speaker's trainer state, listener's version) as /progress says

    def speaker_at(step: int) -> bool:
        doc = e2e.progress(JOB, namespace)
        policies = {p["name"]: p for p in doc["policies"]} if doc else {}
        if "speaker" in policies:
            trainer, listener = policies["speaker"]["trainerState"], policies["listener"]["version"]
            seen.append({"speaker": trainer, "listener": listener})
        return bool(policies) and policies["speaker"]["step"] >= step

    e2e.eventually(partial(speaker_at, 4), timeout=300, what="the speaker's step 4 (checkpoint at 3)")
    e2e.kubelet.kill(namespace, f"{JOB}-speaker-trainer-0")

    def succeeded() -> bool:
        speaker_at(0)  # keeps sampling /progress while the speaker recovers
        return bool(e2e.job(JOB, namespace).get("status", {}).get("phase") == "Succeeded")

    e2e.eventually(succeeded, timeout=400, what="Succeeded")
    status = e2e.job(JOB, namespace)["status"]
    assert status["restarts"] == 0, e2e.restarts_report(JOB, namespace)  # the job did not restart
    by_name = {p["name"]: p for p in status["policies"]}
    assert by_name["speaker"]["restarts"] == 1 and by_name["listener"]["restarts"] == 0, json.dumps(status)
    started = [r.name for r in e2e.kubelet.started(namespace)]
    # only the speaker's trainer pod was created again; the coordinator never restarted
    assert sorted(started) == sorted([f"{JOB}-coordinator", f"{JOB}-workflow-0", f"{JOB}-speaker-trainer-0",
        f"{JOB}-speaker-trainer-0", f"{JOB}-speaker-rollout-0", f"{JOB}-listener-trainer-0",
        f"{JOB}-listener-rollout-0"])  # fmt: skip
    # the listener trained on while the speaker's trainer restarted
    during = [s["listener"] for s in seen if s["speaker"] == "restarting"]
    assert len(during) >= 2 and during[-1] > during[0], seen
    log = (e2e.kubelet.current(namespace, f"{JOB}-coordinator").directory / "main.log").read_text()  # type: ignore[union-attr]
    failed = [json.loads(x) for x in log.splitlines() if '"policy.trainer_failed"' in x]
    restarted = [json.loads(x) for x in log.splitlines() if '"policy.trainer_restarted"' in x]
    assert len(failed) == len(restarted) == 1, log[-3000:]
    # It lost at most the steps since its latest checkpoint: it restarted from the newest speaker
    # state saved before the failure: its step in a job checkpoint (cut every 3 steps of the slower
    # policy, so the speaker's step in it may be past a multiple of 3) or its own restart point (3
    # of its steps past that), or from the start if there was none. A checkpoint cut after the
    # failure carries the speaker's entry of that one (`trainer_at`).
    lines = [json.loads(x) for x in log.splitlines() if '"checkpoint.' in x]
    before = [c for c in lines if c["timestamp"] < failed[0]["timestamp"]]
    saved = [c["steps"]["speaker"] for c in before if c["event"] == "checkpoint.committed"] + [
        c["step"] for c in before if c["event"] == "checkpoint.restart_point" and c["policy"] == "speaker"
    ]
    assert restarted[0]["step"] == max(saved, default=0), (lines, restarted)
    lost = failed[0]["step"] - restarted[0]["step"]
    assert lost >= 0, (failed, restarted)
    counters = e2e.counters(JOB, namespace)
    accounted(counters)  # no episode lost: every sample trained on, dropped with a reason or buffered
    assert counters["steps"] == {"speaker": STEPS, "listener": STEPS}
    assert counters["buffers"]["listener"]["consumed"] == STEPS * EPISODES, counters
    # the lost steps were trained again on new samples; a step whose samples were acknowledged but
    # whose weights never reached the engines (the kill hit its publish) counts as one more
    consumed = counters["buffers"]["speaker"]["consumed"]
    assert consumed in ((STEPS + lost) * EPISODES, (STEPS + lost + 1) * EPISODES), counters


def test_an_operator_restart_mid_run_changes_nothing(e2e: E2E, namespace: str) -> None:
    e2e.start_operator()
    e2e.apply(job(), namespace)
    e2e.eventually(lambda: e2e.step(JOB, namespace) >= 3, timeout=240, what="step 3")
    e2e.kill_operator()
    e2e.eventually(lambda: e2e.step(JOB, namespace) >= 6, timeout=120, what="training on without an operator")
    e2e.start_operator()
    e2e.wait(JOB, namespace, "Succeeded", timeout=400)
    names = [r.name for r in e2e.kubelet.started(namespace)]
    assert len(names) == len(set(names)) == 4, names  # no pod was created twice
    assert e2e.job(JOB, namespace)["status"]["restarts"] == 0, e2e.restarts_report(JOB, namespace)
    trained_exactly_once(e2e.counters(JOB, namespace))


def test_suspend_and_resume_continue_from_the_checkpoint(e2e: E2E, namespace: str) -> None:
    e2e.start_operator()
    e2e.apply(job(LONG), namespace)
    e2e.eventually(lambda: e2e.step(JOB, namespace) >= 4, timeout=240, what="step 4")
    e2e.kubectl("patch", "rljob", JOB, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    e2e.wait(JOB, namespace, "Suspended", timeout=180)
    e2e.eventually(lambda: not e2e.pods(namespace), timeout=120, what="every pod gone while suspended")
    # the coordinator checkpointed on the operator's request before its pods went
    checkpointed = e2e.job(JOB, namespace)["status"]["policies"][0]["lastCheckpointStep"]
    assert checkpointed >= 4
    e2e.kubectl("patch", "rljob", JOB, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    e2e.wait(JOB, namespace, "Succeeded", timeout=400)
    log = (e2e.kubelet.current(namespace, f"{JOB}-coordinator").directory / "main.log").read_text()  # type: ignore[union-attr]
    resumed = [line for line in log.splitlines() if "job.resumed" in line]
    assert resumed, log[-2000:]  # from the checkpoint it wrote on request (status may lag behind it)
    assert json.loads(resumed[-1])["steps"]["agent"] >= checkpointed, resumed
    trained_exactly_once(e2e.counters(JOB, namespace), LONG)


def test_a_coordinator_failing_past_max_restarts_fails_the_job(e2e: E2E, namespace: str) -> None:
    e2e.start_operator()
    e2e.apply(selfplay(failurePolicy={"maxRestarts": 1}), namespace)
    coordinator = f"{JOB}-coordinator"

    def attempts() -> int:
        return len([r for r in e2e.kubelet.started(namespace) if r.name == coordinator])

    for attempt in (1, 2):  # crash it each time it is (re)started: attempt 2 is past maxRestarts 1
        e2e.eventually(
            partial(lambda n: attempts() == n, attempt), timeout=180, what=f"coordinator start {attempt}"
        )
        e2e.kubelet.kill(namespace, coordinator)
    e2e.wait(JOB, namespace, "Failed", timeout=180)
    failed = e2e.condition(JOB, namespace, "Failed")
    assert failed["reason"] == "RestartLimitExceeded", failed
    assert coordinator in failed["message"] and "137" in failed["message"], failed
    status = e2e.job(JOB, namespace)["status"]
    assert status["phase"] == "Failed" and status["restarts"] == 1, json.dumps(status)
    e2e.eventually(lambda: not e2e.pods(namespace) or all(
        p["status"]["phase"] in ("Succeeded", "Failed") for p in e2e.pods(namespace).values()),
        timeout=120, what="the failed job's pods stopped")  # fmt: skip
