"""A job with a frozen judge and a frozen teacher, applied with kubectl, trains to Succeeded through
real pods: the solver's reward is the judge's verdict (LLM-as-judge, workflows/judge.py) and its
trainer pod distils from the teacher (algorithm.distillation). Neither frozen policy gets a trainer
pod; the judge's rollout pod serves every verdict (its turns are dropped as policy_frozen), the
teacher's rollout pod serves nothing (the trainer pod scores with the teacher's own weights)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_testenv.bad_rljobs import EXAMPLES

from .conftest import E2E, accounted

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

JOB, STEPS = "judged-student", 4


def job(rows: Path) -> dict[str, Any]:
    """The frozen-listener example's pods and resources, with three policies: a trained solver, a
    frozen judge of its replies, and a frozen teacher it distils from (built-in tiny models, one
    tokenizer)."""
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "signal-game-frozen-listener-cpu.yaml").read_text())
    speaker, listener = doc["spec"]["policies"]
    solver = copy.deepcopy(speaker) | {"name": "solver"}
    solver["algorithm"] = {"name": "grpo", "groupSize": 4, "lr": 1e-2, "distillation": {"teacher": "teacher"}}
    judge = copy.deepcopy(listener) | {"name": "judge"}
    teacher = copy.deepcopy(listener) | {"name": "teacher"}
    for p in (judge, teacher):
        p["rollout"]["replicas"] = {"min": 1, "max": 1}
    # Digits, not y / n: kubectl reads YAML 1.1, where an unquoted n is false.
    judging = {"agent": "judge", "chat": False, "verdicts": {"1": 1.0, "0": 0.0}}
    doc["metadata"]["name"] = JOB
    doc["spec"] |= {
        "mode": "sync",
        "maxStaleness": 0,
        "training": {"totalSteps": STEPS, "episodesPerStep": 8, "seed": 7},
        "data": {"train": f"file://{rows}"},
        "workflow": {
            "entrypoint": "polyrl_runtime.workflows.prompts:PromptCompletion",
            "args": {
                "agent": "solver",
                "max_new_tokens": 2,
                "judge": judging,
                "policies": {"solver": "solver", "judge": "judge"},
            },
            "replicas": {"min": 1, "max": 1},
        },
        "policies": [solver, judge, teacher],
        "checkpoint": {"everySteps": STEPS, "keep": 1},
    }
    return doc


def test_a_solver_judged_by_one_frozen_policy_distils_from_another(e2e: E2E, namespace: str) -> None:
    rows = e2e.workdir / "train.jsonl"
    rows.write_text("".join(f'{{"prompt": "{i}+0=", "answer": {i}}}\n' for i in range(8)))
    e2e.start_operator()
    e2e.apply(job(rows), namespace)
    e2e.wait(JOB, namespace, "Ready", timeout=240)
    pods = set(e2e.pods(namespace))
    for p in ("solver-trainer-0", "judge-rollout-0", "teacher-rollout-0"):
        assert f"{JOB}-{p}" in pods, sorted(pods)
    assert not any("judge-trainer" in p or "teacher-trainer" in p for p in pods), sorted(pods)
    e2e.wait(JOB, namespace, "Succeeded", timeout=600)

    status = e2e.job(JOB, namespace)["status"]
    assert status["restarts"] == 0, e2e.restarts_report(JOB, namespace)
    policies = {p["name"]: p for p in status["policies"]}
    assert policies["judge"]["trainerState"] == policies["teacher"]["trainerState"] == "frozen", policies
    assert policies["solver"]["step"] == STEPS, policies
    counters = e2e.counters(JOB, namespace)
    accounted(counters)  # no episode failed: every verdict (constrained to a digit) was read
    assert counters["steps"] == {"solver": STEPS, "judge": 0, "teacher": 0}, counters
    judge = counters["buffers"]["judge"]
    assert judge["consumed"] == 0 and counters["dropped"]["judge"]["policy_frozen"] == judge["produced"] > 0
    assert counters["buffers"]["teacher"]["produced"] == 0  # the workflow never calls the teacher

    # The solver's trainer pod scored its tokens with the teacher: its metrics rows carry the KL.
    kls = [
        row["distill_kl"]
        for f in e2e.kubelet.root.rglob("metrics*.jsonl")
        for row in map(json.loads, f.read_text().splitlines())
        if row["policy"] == "solver"
    ]
    assert len(kls) >= STEPS and all(k != 0.0 for k in kls), kls  # an estimate: either sign
