"""`spec.metrics` in the API and the pods: sinks validated naming the field, and the metrics
credentials Secret reaching the coordinator (where the sinks run) and no other pod."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator.api import RLJob
from polyrl_operator.builders import JobRef, PodRequest, build_pod
from polyrl_operator.settings import OperatorSettings
from polyrl_operator.validation import validate_file
from polyrl_testenv.bad_rljobs import base_job
from polyrl_testenv.operator_fixtures import gpu_job

REF = JobRef("debate", "team-a", "uid-1")


def _job(spec: dict[str, Any]) -> RLJob:
    body = gpu_job()
    body["spec"].update(spec)
    return RLJob.model_validate(
        {k: v for k, v in body.items() if k != "metadata"}
        | {"metadata": {"name": "debate", "namespace": "team-a"}}
    )


def _env_from(job: RLJob, req: PodRequest) -> Any:
    [container] = build_pod(job, REF, req, OperatorSettings())["spec"]["containers"]
    return container.get("envFrom")


@pytest.mark.parametrize(
    ("spec", "coordinator", "others"),
    [
        ({}, None, None),
        ({"metrics": {"credentialsSecret": "wandb-key"}}, [{"secretRef": {"name": "wandb-key"}}], None),
        (
            {"metrics": {"credentialsSecret": "wandb-key"}, "storage": {"credentialsSecret": "s3"}},
            [{"secretRef": {"name": "s3"}}, {"secretRef": {"name": "wandb-key"}}],
            [{"secretRef": {"name": "s3"}}],
        ),
        (  # one Secret for both: listed once
            {"metrics": {"credentialsSecret": "all"}, "storage": {"credentialsSecret": "all"}},
            [{"secretRef": {"name": "all"}}],
            [{"secretRef": {"name": "all"}}],
        ),
    ],
    ids=["unset", "metrics-secret", "both-secrets", "same-secret"],
)
def test_the_metrics_secret_reaches_the_coordinator_only(
    spec: dict[str, Any], coordinator: Any, others: Any
) -> None:
    job = _job(spec)
    assert _env_from(job, PodRequest("coordinator")) == coordinator
    for req in (
        PodRequest("workflow", 0),
        PodRequest("rollout", 0, "proposer"),
        PodRequest("trainer", 0, "judge"),
    ):
        assert _env_from(job, req) == others, req.role


@pytest.mark.parametrize(
    ("metrics", "field", "hint"),
    [
        ({"sinks": [{"type": "wandb"}]}, "spec.metrics.sinks[0].project", "a wandb sink needs a project"),
        (
            {"sinks": [{"type": "tensorboard"}, {"type": "mlflow"}]},
            "spec.metrics.sinks[1].trackingUri",
            "an mlflow sink needs a trackingUri",
        ),
        ({"sinks": [{"type": "prometheus"}]}, "spec.metrics.sinks[0].type", "tensorboard"),
        (
            {"sinks": [{"type": "wandb", "project": "p", "mode": "cloud"}]},
            "spec.metrics.sinks[0].mode",
            "offline",
        ),
        ({"sinks": [{"type": "mlflow", "trackingUri": "ftp://x"}]}, "spec.metrics.sinks[0].trackingUri", ""),
        ({"sinks": [{"type": "tensorboard", "logDir": "gs://b/tb"}]}, "spec.metrics.sinks[0].logDir", ""),
        ({"credentialsSecret": "Bad_Name"}, "spec.metrics.credentialsSecret", ""),
        ({"maxSinkFailures": 0}, "spec.metrics.maxSinkFailures", ""),
    ],
)
def test_bad_metrics_settings_are_refused_naming_the_field(
    tmp_path: Path, metrics: dict[str, Any], field: str, hint: str
) -> None:
    doc = base_job()
    doc["spec"]["metrics"] = metrics
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump(doc))
    problems = {p.path: p.message for p in validate_file(file).problems}
    assert field in problems, problems
    assert hint in problems[field], problems[field]


def test_every_sink_kind_is_accepted(tmp_path: Path) -> None:
    doc = base_job()
    doc["spec"]["metrics"] = {
        "sinks": [
            {"type": "tensorboard", "logDir": "s3://team/tb/debate"},
            {"type": "wandb", "project": "rl", "entity": "team", "mode": "offline"},
            {"type": "mlflow", "trackingUri": "https://mlflow.example.com", "experiment": "debate"},
        ],
        "credentialsSecret": "metrics-creds",
    }
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump(doc))
    assert validate_file(file).problems == []
