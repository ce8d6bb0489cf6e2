"""The RLJob status per policy (``polyrl_operator.planning.status``) carries the coordinator's
latest evaluation pass (spec.evaluation): taken from /progress when there, kept as last written when
a report has none."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from polyrl_operator.api import RLJob, RLJobStatus
from polyrl_operator.api.progress import EvalProgress, PolicyProgress, Progress
from polyrl_operator.api.status import EvalStatus, PolicyStatus
from polyrl_operator.planning.pods import empty_pod_plan
from polyrl_operator.planning.status import policy_statuses
from polyrl_testenv.bad_rljobs import REPO

JOB = RLJob.model_validate(
    yaml.safe_load((REPO / "tests" / "runtime" / "data" / "selfplay-tiny.yaml").read_text())
)


PASS = EvalProgress(step=6, reward_mean=0.25, pass_at_k=0.5, k=4, rows=10)


OLD = EvalStatus(step=3, reward_mean=0.1, pass_at_k=0.2, k=4)


@pytest.mark.parametrize(
    ("old_eval", "report", "expected"),
    [
        (None, PASS, {"step": 6, "rewardMean": 0.25, "passAtK": 0.5, "k": 4}),
        (OLD, PASS, {"step": 6, "rewardMean": 0.25, "passAtK": 0.5, "k": 4}),
        (OLD, None, {"step": 3, "rewardMean": 0.1, "passAtK": 0.2, "k": 4}),  # no new pass: kept
        (None, None, None),  # a job without evaluation shows none
    ],
)
def test_policy_status_carries_the_latest_eval_pass(
    old_eval: EvalStatus | None, report: EvalProgress | None, expected: dict[str, Any] | None
) -> None:
    old = RLJobStatus(policies=[PolicyStatus(name="agent", evaluation=old_eval)])
    progress = Progress(state="running", policies=[PolicyProgress(name="agent", step=6, evaluation=report)])
    [status] = policy_statuses(JOB, old, progress, empty_pod_plan(JOB))
    wire = status.model_dump(by_alias=True, exclude_none=True, mode="json").get("evaluation")
    assert wire == expected
