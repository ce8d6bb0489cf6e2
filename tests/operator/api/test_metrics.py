"""``spec.metrics`` (``polyrl_operator.api.metrics``): sinks validated naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator.validation import validate_file
from polyrl_testenv.bad_rljobs import base_job


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
