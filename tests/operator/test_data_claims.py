"""The coordinator, which reads spec.data, mounts the data's claims read-only; other roles do not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator.api import RLJob
from polyrl_operator.builders.pods import claims

BASE = yaml.safe_load((Path(__file__).parents[1] / "runtime" / "data" / "selfplay-tiny.yaml").read_text())


def job(data: dict[str, Any] | None, ckpt: str | None = None) -> RLJob:
    doc = yaml.safe_load(yaml.safe_dump(BASE))
    if data is not None:
        doc["spec"]["data"] = data
    if ckpt is not None:
        doc["spec"]["checkpoint"]["uri"] = ckpt
    return RLJob.model_validate(doc)


@pytest.mark.parametrize(
    ("data", "ckpt", "role", "expected"),
    [
        ({"train": "pvc://prompts/train.jsonl"}, None, "coordinator", {"prompts": True}),
        (
            {"train": "pvc://prompts/t.jsonl", "eval": "pvc://evals/e.parquet"},
            None,
            "coordinator",
            {"prompts": True, "evals": True},
        ),
        ({"train": "pvc://prompts/train.jsonl"}, None, "workflow", {}),
        ({"train": "s3://bucket-a/train.jsonl"}, None, "coordinator", {}),
        (
            {"train": "pvc://shared/data/train.jsonl"},
            "pvc://shared/ckpt",
            "coordinator",
            {"shared": False},
        ),  # writable wins
        (None, None, "coordinator", {}),
    ],
)
def test_data_claims(
    data: dict[str, Any] | None, ckpt: str | None, role: str, expected: dict[str, bool]
) -> None:
    assert claims(job(data, ckpt), role, None) == expected  # type: ignore[arg-type]
