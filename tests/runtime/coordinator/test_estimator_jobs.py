"""Every advantage estimator trains a job end to end (workers, buffer, DeepSpeed rank): the
estimators' formulas are tested on fixed tensors in tests/runtime/algorithms/test_estimators.py;
here each one's signals reach the trainer and take optimizer steps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from driver_harness import make_job, policy, run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["dr_grpo", "rloo", "reinforce_pp"])
def test_a_job_trains_with_each_estimator(ray_local: Any, tmp_path: Path, name: str) -> None:
    job = make_job(
        mode="sync",
        maxStaleness=0,
        training={"totalSteps": 2},
        policies=[policy(algorithm={"name": name})],
    )
    _, summary = run(job, tmp_path)
    assert summary.state == "done", summary.message
    assert [r.step for r in summary.records] == [1, 2]
    assert all(r.samples > 0 and math.isfinite(r.loss) for r in summary.records)
    assert any(r.grad_norm > 0 for r in summary.records)  # the signals carried a gradient
