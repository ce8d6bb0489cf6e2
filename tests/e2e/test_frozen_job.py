"""A job with a frozen policy (`frozen: true`) applied with kubectl trains to Succeeded through real
pods: the operator creates no trainer pod for the frozen listener, its rollout pod serves it, status
shows it frozen, and every one of its samples is dropped as policy_frozen while the speaker trains."""

from __future__ import annotations

import pytest
import yaml

from polyrl_testenv.bad_rljobs import EXAMPLES

from .conftest import E2E, accounted

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

JOB, STEPS = "signal-game-frozen-listener", 6


def test_a_frozen_listener_is_served_by_its_pod_and_never_trained(e2e: E2E, namespace: str) -> None:
    doc = yaml.safe_load((EXAMPLES / "signal-game-frozen-listener-cpu.yaml").read_text())
    doc["spec"]["training"] = {"totalSteps": STEPS, "episodesPerStep": 16, "seed": 7}
    e2e.start_operator()
    e2e.apply(doc, namespace)
    e2e.wait(JOB, namespace, "Ready", timeout=240)
    pods = set(e2e.pods(namespace))
    assert f"{JOB}-listener-rollout-0" in pods and f"{JOB}-speaker-trainer-0" in pods, sorted(pods)
    assert not any("listener-trainer" in p for p in pods), sorted(pods)
    e2e.wait(JOB, namespace, "Succeeded", timeout=600)

    status = e2e.job(JOB, namespace)["status"]
    assert status["restarts"] == 0, e2e.restarts_report(JOB, namespace)
    policies = {p["name"]: p for p in status["policies"]}
    assert policies["listener"]["trainerState"] == "frozen", policies["listener"]
    assert policies["listener"]["step"] == 0 and policies["speaker"]["step"] == STEPS, policies
    counters = e2e.counters(JOB, namespace)
    accounted(counters)
    assert counters["steps"] == {"speaker": STEPS, "listener": 0}, counters
    listener = counters["buffers"]["listener"]
    assert (
        listener["consumed"] == 0
        and counters["dropped"]["listener"]["policy_frozen"] == listener["produced"] > 0
    )
