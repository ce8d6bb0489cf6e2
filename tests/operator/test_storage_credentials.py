"""Object-storage access in the API and the pods: `spec.storage.credentialsSecret` becomes every pod's
environment (envFrom), and URIs the runtime cannot read (gs://) are refused with the reason."""

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
PODS = (
    PodRequest("coordinator"),
    PodRequest("workflow", 0),
    PodRequest("rollout", 1, "proposer"),
    PodRequest("trainer", 0, "judge"),
)


def _job(storage: dict[str, Any] | None, env: list[dict[str, Any]] | None = None) -> RLJob:
    body = gpu_job()
    if storage is not None:
        body["spec"]["storage"] = storage
    if env is not None:
        body["spec"]["coordinator"] = {**body["spec"].get("coordinator", {}), "env": env}
    return RLJob.model_validate(
        {k: v for k, v in body.items() if k != "metadata"}
        | {"metadata": {"name": "debate", "namespace": "team-a"}}
    )


def _container(job: RLJob, req: PodRequest) -> dict[str, Any]:
    [container] = build_pod(job, REF, req, OperatorSettings())["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize(
    ("storage", "env_from", "secret_env"),
    [
        (None, None, None),
        ({}, None, None),
        ({"credentialsSecret": "s3-creds"}, [{"secretRef": {"name": "s3-creds"}}], "s3-creds"),
        ({"credentialsSecret": "team.s3"}, [{"secretRef": {"name": "team.s3"}}], "team.s3"),
    ],
    ids=["unset", "empty", "secret", "dotted-name"],
)
@pytest.mark.parametrize("req", PODS, ids=lambda r: r.role)
def test_every_pod_gets_the_credentials_secret_as_environment(
    storage: dict[str, Any] | None,
    env_from: list[dict[str, Any]] | None,
    secret_env: str | None,
    req: PodRequest,
) -> None:
    container = _container(_job(storage), req)
    assert container.get("envFrom") == env_from
    assert _env(container).get("POLYRL_CREDENTIALS_SECRET") == secret_env


def test_a_roles_own_env_wins_over_the_secret_name() -> None:
    job = _job(
        {"credentialsSecret": "s3-creds"}, env=[{"name": "POLYRL_CREDENTIALS_SECRET", "value": "mine"}]
    )
    coordinator = _container(job, PodRequest("coordinator"))
    assert [e for e in coordinator["env"] if e["name"] == "POLYRL_CREDENTIALS_SECRET"] == [
        {"name": "POLYRL_CREDENTIALS_SECRET", "value": "mine"}
    ]
    assert coordinator["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]


@pytest.mark.parametrize(
    ("path", "value", "field", "hint"),
    [
        ("model", "gs://models/qwen", "spec.policies[0].model.uri", "gs:// is not supported"),
        ("checkpoint", "gs://ckpt/run", "spec.checkpoint.uri", "gs:// is not supported"),
        ("checkpoint", "s3://", "spec.checkpoint.uri", "s3://BUCKET/PREFIX"),
        ("model", "s3://A_B/x", "spec.policies[0].model.uri", "s3://BUCKET/PREFIX"),
    ],
)
def test_uris_the_runtime_cannot_read_are_refused_with_the_reason(
    tmp_path: Path, path: str, value: str, field: str, hint: str
) -> None:
    doc = base_job()
    if path == "model":
        doc["spec"]["policies"][0]["model"]["uri"] = value
    else:
        doc["spec"].setdefault("checkpoint", {})["uri"] = value
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump(doc))
    problems = {p.path: p.message for p in validate_file(file).problems}
    assert field in problems, problems
    assert hint in problems[field], problems[field]


def test_s3_uris_are_accepted(tmp_path: Path) -> None:
    doc = base_job()
    doc["spec"]["policies"][0]["model"]["uri"] = "s3://models/qwen2.5-0.5b"
    doc["spec"]["checkpoint"] = {"uri": "s3://team-ckpt/jobs/debate"}
    doc["spec"]["storage"] = {"credentialsSecret": "s3-creds"}
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump(doc))
    assert validate_file(file).problems == []
