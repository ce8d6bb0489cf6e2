"""The coordinator's ``/progress`` schema (``polyrl_operator.api.progress``): recorded samples parse
and round-trip; documents of older coordinators still parse."""

from __future__ import annotations

import pytest

from polyrl_operator.api.progress import Progress
from polyrl_testenv.operator_fixtures import PROGRESS_SAMPLES


@pytest.mark.parametrize("sample", sorted(p.stem for p in PROGRESS_SAMPLES.glob("*.json")))
def test_recorded_progress_samples_parse(sample: str) -> None:
    doc = Progress.model_validate_json((PROGRESS_SAMPLES / f"{sample}.json").read_text())
    assert doc.schema_version == 1
    assert Progress.model_validate(doc.to_wire()) == doc


def test_progress_without_the_field_still_parses() -> None:
    """An older coordinator's document (no `evaluation`, no `pools`) is read as before."""
    doc = {"schemaVersion": 1, "state": "running", "policies": [{"name": "agent", "step": 2}]}
    parsed = Progress.model_validate(doc)
    assert parsed.policies[0].evaluation is None and parsed.pools == []


def test_the_version_skew_per_other_policy_parses() -> None:
    doc = Progress.model_validate_json((PROGRESS_SAMPLES / "running.json").read_text())
    speaker, listener = doc.policies
    assert speaker.version_skew == {"listener": 1} and listener.version_skew is None
