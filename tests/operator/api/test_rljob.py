"""The RLJob model (``polyrl_operator.api``): examples parse, defaults are what DESIGN.md promises, the
wire form round-trips, fields keep their types."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from polyrl_operator.api import Placement, RLJob, longest_pod_name_len
from polyrl_testenv.bad_rljobs import EXAMPLES, base_job
from polyrl_testenv.operator_fixtures import stored_job

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def test_there_are_cpu_and_gpu_examples() -> None:
    names = {p.name for p in EXAMPLE_FILES}
    assert "signal-game-cpu.yaml" in names
    assert "debate-gpu.yaml" in names


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_every_example_parses_and_round_trips(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == "RLJob":
            job = RLJob.model_validate(doc)
            again = RLJob.model_validate(job.to_k8s())
            assert again == job


def test_gpu_example_is_heterogeneous() -> None:
    job = RLJob.model_validate(yaml.safe_load((EXAMPLES / "debate-gpu.yaml").read_text()))
    assert len(job.spec.policies) == 3
    for p in job.spec.policies:
        assert p.rollout.gpu_type and p.trainer.gpu_type
        assert p.rollout.gpu_type != p.trainer.gpu_type


def test_minimal_job_gets_documented_defaults() -> None:
    job = RLJob.model_validate(
        {
            "apiVersion": "polyrl.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "m"},
            "spec": {
                "training": {"totalSteps": 10},
                "workflow": {"entrypoint": "pkg.mod:Game"},
                "policies": [{"name": "a", "model": {"uri": "builtin://tiny"}}],
            },
        }
    )
    spec = job.spec
    assert spec.mode == "async"
    assert spec.effective_max_staleness == 2
    assert spec.training.episodes_per_step == 64
    assert spec.weight_sync.transport == "auto"
    assert spec.weight_sync.bucket_mb == 256
    assert spec.failure_policy.max_restarts == 3
    policy = spec.policies[0]
    assert (policy.algorithm.name, policy.algorithm.group_size) == ("grpo", 8)
    # Unset replicas and gpus stay unset in the spec; the placement resolves their defaults.
    assert (policy.rollout.engine, policy.rollout.gpus, policy.rollout.replicas) == ("vllm", None, None)
    assert (policy.trainer.backend, policy.trainer.zero_stage, policy.trainer.replicas) == (
        "deepspeed",
        2,
        None,
    )
    assert spec.rollout_placement(policy) == Placement(None, 1, None, 1, 1)
    assert spec.trainer_placement(policy) == Placement(None, 1, None, 1, 1, ranks_per_pod=1)


def test_sync_mode_has_zero_staleness() -> None:
    doc = base_job()
    doc["spec"]["mode"] = "sync"
    del doc["spec"]["maxStaleness"]
    assert RLJob.model_validate(doc).spec.effective_max_staleness == 0


def test_wire_form_is_camel_case_and_omits_unset() -> None:
    wire = RLJob.model_validate(base_job()).to_k8s()
    policy = wire["spec"]["policies"][0]
    assert "groupSize" in policy["algorithm"]
    assert "bucketMB" in wire["spec"]["weightSync"]
    assert "scheduling" not in wire["spec"]
    assert "status" not in wire


def test_strict_types_no_silent_coercion() -> None:
    doc = base_job()
    doc["spec"]["training"]["totalSteps"] = "60"
    with pytest.raises(ValidationError, match="totalSteps"):
        RLJob.model_validate(doc)


def test_longest_pod_name_counts_the_index_digits() -> None:
    # "j-p-rollout-9" for max 10 replicas, "j-p-rollout-10" for 11.
    assert longest_pod_name_len("j", "p", 10, 1) == len("j-p-rollout-9")
    assert longest_pod_name_len("j", "p", 1, 11) == len("j-p-trainer-10")


def test_the_dashboard_field_is_a_boolean() -> None:
    body = stored_job()
    body["metadata"] = {"name": "signal-game", "namespace": "ns"}
    body["spec"]["coordinator"] = {"dashboard": "sometimes"}
    with pytest.raises(ValueError, match=r"coordinator\.dashboard"):
        RLJob.model_validate(body)
