"""URIs in the spec (``polyrl_operator.api.spec``): the ones the runtime cannot read (gs://) are
refused with the reason; s3:// is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from polyrl_operator.validation import validate_file
from polyrl_testenv.bad_rljobs import base_job


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
