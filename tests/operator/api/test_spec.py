"""The spec (``polyrl_operator.api.spec``): the URIs the runtime cannot read (gs://) are refused with
the reason, s3:// is accepted; a policy's failurePolicy overrides the job's field by field, and
onPolicyFailure freeze needs a second policy to train on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from polyrl_operator.api import RLJob
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


# (job failurePolicy, speaker's failurePolicy) -> speaker's (maxRestarts, onPolicyFailure); the
# listener, with none of its own, always takes the job's.
@pytest.mark.parametrize(
    ("job", "own", "expected"),
    [
        (None, None, (3, "failJob")),  # the defaults
        ({"maxRestarts": 5, "onPolicyFailure": "freeze"}, None, (5, "freeze")),
        ({"maxRestarts": 5}, {"maxRestarts": 1}, (1, "failJob")),
        ({"onPolicyFailure": "freeze"}, {"onPolicyFailure": "failJob"}, (3, "failJob")),
        ({"maxRestarts": 5, "onPolicyFailure": "failJob"}, {"onPolicyFailure": "freeze"}, (5, "freeze")),
        ({"maxRestarts": 5}, {"maxRestarts": 0, "onPolicyFailure": "freeze"}, (0, "freeze")),  # 0 is set
        ({"maxRestarts": 2}, {}, (2, "failJob")),  # an empty override overrides nothing
    ],
)
def test_a_policy_s_failure_policy_overrides_the_job_s_field_by_field(
    job: dict[str, Any] | None, own: dict[str, Any] | None, expected: tuple[int, str]
) -> None:
    doc = base_job()
    if job is not None:
        doc["spec"]["failurePolicy"] = job
    if own is not None:
        doc["spec"]["policies"][0]["failurePolicy"] = own
    spec = RLJob.model_validate(doc).spec
    assert spec.policy_failure("speaker") == expected
    whole = spec.failure_policy
    assert spec.policy_failure("listener") == (whole.max_restarts, whole.on_policy_failure)


@pytest.mark.parametrize(
    ("where", "policies", "ok"),
    [
        ("job", 2, True),
        ("policy", 2, True),
        ("job", 1, False),
        ("policy", 1, False),
        (None, 1, True),  # failJob, the default, needs no other policy
    ],
)
def test_freeze_needs_two_policies(where: str | None, policies: int, ok: bool) -> None:
    doc = base_job()
    doc["spec"]["policies"] = doc["spec"]["policies"][:policies]
    if where == "job":
        doc["spec"]["failurePolicy"] = {"onPolicyFailure": "freeze"}
    elif where == "policy":
        doc["spec"]["policies"][0]["failurePolicy"] = {"onPolicyFailure": "freeze"}
    if ok:
        RLJob.model_validate(doc)
        return
    with pytest.raises(ValidationError, match=r"failurePolicy\.onPolicyFailure: freeze needs two policies"):
        RLJob.model_validate(doc)


@pytest.mark.parametrize(
    ("correction", "ok"), [("none", True), ("token-truncate", False), ("sequence-truncate", False)]
)
def test_top_p_under_one_needs_is_correction_none(tmp_path: Path, correction: str, ok: bool) -> None:
    """Without importance weights nothing divides by the engine's nucleus-blind log-probabilities."""
    doc = base_job()
    policy = doc["spec"]["policies"][0]
    policy.setdefault("rollout", {}).setdefault("sampling", {})["topP"] = 0.9
    policy.setdefault("algorithm", {})["isCorrection"] = correction
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump(doc))
    problems = {p.path: p.message for p in validate_file(file).problems}
    field = "spec.policies[0].rollout.sampling.topP"
    assert (field not in problems) is ok, problems
    assert ok or "isCorrection is none" in problems[field]
