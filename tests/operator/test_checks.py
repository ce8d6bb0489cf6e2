"""The operator's own checks (``polyrl_operator.checks``) on top of the CRD's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from polyrl_operator.api import RLJob
from polyrl_operator.checks import operator_checks
from polyrl_operator.cli import main
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv.bad_rljobs import EXAMPLES
from polyrl_testenv.operator_fixtures import pooled_cpu_job, pooled_gpu_job


def test_kueue_off_rejects_jobs_that_name_a_queue(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    settings = tmp_path / "settings.yaml"
    settings.write_text("kueue: {enabled: false}\n")
    assert main(["render", str(EXAMPLES / "debate-gpu.yaml"), "--settings", str(settings)]) == 1
    assert "spec.scheduling.queueName" in capsys.readouterr().err
    off = OperatorSettings.model_validate({"kueue": {"enabled": False}})
    assert "Workload" not in off.child_kinds()
    assert main(["render", str(EXAMPLES / "signal-game-cpu.yaml"), "--settings", str(settings)]) == 0


def test_a_pooled_job_passes_the_checks_and_a_pool_s_gpu_type_is_checked() -> None:
    job = RLJob.model_validate(pooled_gpu_job())
    strict = OperatorSettings(strict_gpu_types=True, gpu_types={"l40s": {}, "a100-80gb": {}})
    assert operator_checks(job, OperatorSettings()) == []
    paths = [path for path, _ in operator_checks(job, strict)]
    assert paths == [
        "spec.policies[1].trainer.gpuType",
        "spec.policies[2].trainer.gpuType",
        "spec.pools[0].gpuType",
    ]


def test_kueue_podsets_count_a_pool_once() -> None:
    """Ten dedicated policies need 22 podSets, more than a Workload allows; on one pool they fit."""
    doc = pooled_cpu_job()
    policy = doc["spec"]["policies"][0]
    doc["spec"]["policies"] = [{**copy.deepcopy(policy), "name": f"p{i}"} for i in range(10)]
    doc["spec"]["scheduling"] = {"queueName": "team-a"}
    assert operator_checks(RLJob.model_validate(doc), OperatorSettings()) == []
    for p in doc["spec"]["policies"]:
        p["rollout"], p["trainer"] = {"engine": "torch", "gpus": 0}, {"gpus": 0}
    del doc["spec"]["pools"]
    [(path, message)] = operator_checks(RLJob.model_validate(doc), OperatorSettings())
    assert path == "spec.policies" and message.startswith("10 policies need 22 Kueue podSets")
