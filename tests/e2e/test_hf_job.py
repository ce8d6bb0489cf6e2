"""A job whose policies are Hugging Face models (builtin://tiny-qwen2, loaded with from_pretrained in
every pod) trains through real pods to Succeeded: the engines, trainers and workflow pods each load
the same model directory, and the final versions reach the RLJob's status."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import E2E

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLE = Path(__file__).parents[2] / "manifests" / "examples" / "guessing-hf-cpu.yaml"
STEPS = 6


def job() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["training"].update(totalSteps=STEPS, episodesPerStep=16)
    doc["spec"]["checkpoint"] = {"everySteps": STEPS, "keep": 1}
    for p in doc["spec"]["policies"]:
        p["algorithm"]["groupSize"] = 8
    return doc


def test_a_hugging_face_job_trains_to_succeeded_through_pods(e2e: E2E, namespace: str) -> None:
    e2e.start_operator()
    e2e.apply(job(), namespace)
    e2e.wait("guessing-hf", namespace, "Succeeded", timeout=600)
    status = e2e.job("guessing-hf", namespace)["status"]
    assert status["restarts"] == 0, e2e.restarts_report("guessing-hf", namespace)
    policies = {p["name"]: p for p in status["policies"]}
    assert set(policies) == {"left", "right"}
    for name, p in policies.items():
        assert (p["version"], p["step"]) == (STEPS, STEPS), (name, p)
    # Every pod that loads the model built the same directory and loaded it with from_pretrained.
    files = [p for p in e2e.kubelet.root.rglob("*") if p.is_file() and p.suffix in (".log", ".out", ".err")]
    logs = [p.read_text(errors="replace") for p in files]
    assert sum("Qwen2ForCausalLM" in text for text in logs) >= 4  # 2 engines + 2 trainers
