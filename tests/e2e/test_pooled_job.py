"""A job whose policy is colocated on a device pool trains to Succeeded through the pool's pod: the
operator renders the pool pod, the runtime's pool node offers both roles' resources, the engine and
the trainer ranks run on it, their weights go through the pod's shared memory (`auto`), and status
reports the pool."""

from __future__ import annotations

import json
from typing import Any

import pytest

from .conftest import E2E, accounted, selfplay

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

JOB, STEPS, EPISODES, SAMPLES_PER_EPISODE = "pooled", 8, 8, 2


def pooled(steps: int = STEPS) -> dict[str, Any]:
    """The selfplay job with the agent's rollout and trainer on one pool of one pod (`auto` weights)."""
    doc = selfplay(JOB, training={"totalSteps": steps, "episodesPerStep": EPISODES, "seed": 3})
    doc["spec"]["pools"] = [{"name": "shared", "gpus": 0, "replicas": {"min": 1, "max": 1}}]
    agent = doc["spec"]["policies"][0]
    agent["rollout"] = {"engine": "torch", "pool": "shared"}
    agent["trainer"] = {"backend": "deepspeed", "zeroStage": 1, "microBatchSize": 16, "pool": "shared"}
    doc["spec"]["weightSync"] = {"transport": "auto", "bucketMB": 16}
    return doc


def test_a_colocated_policy_trains_through_its_pool_pod(e2e: E2E, namespace: str) -> None:
    doc = pooled()
    e2e.start_operator()
    e2e.apply(doc, namespace)
    e2e.wait(JOB, namespace, "Ready", timeout=240)  # every pod ready: one Ray cluster formed
    pods = e2e.pods(namespace)
    assert set(pods) == {f"{JOB}-coordinator", f"{JOB}-workflow-0", f"{JOB}-pool-shared-0"}, sorted(pods)
    pool_pod = pods[f"{JOB}-pool-shared-0"]
    assert pool_pod["metadata"]["labels"]["polyrl.dev/pool"] == "shared"
    assert pool_pod["metadata"]["annotations"]["polyrl.dev/serves"] == "agent/rollout,agent/trainer"
    e2e.wait(JOB, namespace, "Succeeded", timeout=600)

    status = e2e.job(JOB, namespace)["status"]
    assert status["restarts"] == 0, e2e.restarts_report(JOB, namespace)
    (pool,) = status["pools"]
    assert (pool["name"], sorted(pool["roles"])) == ("shared", ["agent/rollout", "agent/trainer"]), pool
    (policy,) = status["policies"]
    assert (policy["version"], policy["step"]) == (STEPS, STEPS), policy
    counters = e2e.counters(JOB, namespace)
    accounted(counters)
    assert counters["steps"] == {"agent": STEPS}
    assert counters["buffers"]["agent"]["consumed"] == STEPS * EPISODES * SAMPLES_PER_EPISODE, counters
    started = [r.name for r in e2e.kubelet.started(namespace)]
    assert sorted(started) == sorted(pods), started  # nothing restarted or added
    # engine and trainer in one pod: `auto` chose that pod's shared memory, not the object store
    log = (e2e.kubelet.current(namespace, f"{JOB}-coordinator").directory / "main.log").read_text()  # type: ignore[union-attr]
    chosen = [json.loads(line) for line in log.splitlines() if '"weights.transports"' in line]
    assert [c["transports"] for c in chosen] == [{"agent": "shm"}], log[-2000:]


def shared_lora(steps: int) -> dict[str, Any]:
    """The selfplay game with a policy per side, both LoRA adapters on one base (the tiny Qwen2), their
    rollouts and trainers on one pool pod: one engine and one trainer serve and train both."""
    doc = pooled(steps)
    agent = doc["spec"]["policies"][0]
    agent["model"] = {"uri": "builtin://tiny-qwen2", "dtype": "float32"}
    agent["algorithm"]["lora"] = {"rank": 8, "alpha": 16}
    doc["spec"]["policies"] = [{**agent, "name": name} for name in ("speaker", "listener")]
    doc["spec"]["workflow"]["args"]["policies"] = {"speaker": "speaker", "listener": "listener"}
    return doc


def test_a_pool_pod_that_dies_is_replaced_and_its_roles_resume_from_the_checkpoint(
    e2e: E2E, namespace: str
) -> None:
    """The pool pod hosts the engine and the trainer of two policies that share a base as LoRA adapters:
    its death restarts the training roles from the last checkpoint (as the coordinator's does; a
    trainer pod of its own restarts only its policy's trainer), the pod is created again, both
    policies resume from their own checkpoints, and no sample is lost or trained twice."""
    steps = 16
    doc = shared_lora(steps)
    doc["spec"]["workflow"]["args"]["latency_s"] = 1.0  # steps of >= 0.5 s: the kill lands mid-run
    e2e.start_operator()
    e2e.apply(doc, namespace)
    e2e.eventually(lambda: e2e.step(JOB, namespace) >= 7, timeout=300, what="step 7 (checkpoint at 6)")
    pool_pod = e2e.pods(namespace)[f"{JOB}-pool-shared-0"]
    assert pool_pod["metadata"]["annotations"]["polyrl.dev/shared-bases"].startswith("speaker,listener on ")
    e2e.kubelet.kill(namespace, f"{JOB}-pool-shared-0")
    e2e.wait(JOB, namespace, "Succeeded", timeout=400)
    status = e2e.job(JOB, namespace)["status"]
    assert status["restarts"] == 1, e2e.restarts_report(JOB, namespace)
    (pool,) = status["pools"]
    assert [b["policies"] for b in pool["sharedBases"]] == [["speaker", "listener"]], pool
    started = sorted(r.name for r in e2e.kubelet.started(namespace))
    assert started == sorted(
        [f"{JOB}-coordinator"] * 2 + [f"{JOB}-pool-shared-0"] * 2 + [f"{JOB}-workflow-0"]
    )
    log = (e2e.kubelet.current(namespace, f"{JOB}-coordinator").directory / "main.log").read_text()  # type: ignore[union-attr]
    assert "job.resumed" in log, log[-2000:]
    shared = [json.loads(line) for line in log.splitlines() if '"trainer.shared"' in line]
    assert [s["policies"] for s in shared] == [["speaker", "listener"]], log[-2000:]  # one trainer for both
    counters = e2e.counters(JOB, namespace)
    accounted(counters)
    assert counters["steps"] == {"speaker": steps, "listener": steps}
    for policy in ("speaker", "listener"):  # one sample per episode each
        assert counters["buffers"][policy]["consumed"] == steps * EPISODES, counters
