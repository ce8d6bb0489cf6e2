"""DAPO's dynamic sampling in jobs: equal-reward groups are dropped (counted as zero_variance) and
replaced by new episodes, so each step trains on a full step of groups with a signal; past the
version's cap (maxRefills steps' worth) the version trains on them, so the job still steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from driver_harness import make_job, policy, run

pytestmark = pytest.mark.slow

EPISODES, GROUP = 16, 4  # selfplay-tiny.yaml: episodesPerStep, groupSize


def _job(entrypoint: str, max_refills: int, steps: int) -> Any:
    algorithm = {
        "name": "grpo",
        "groupSize": GROUP,
        "lr": 3.0e-3,
        "dynamicSampling": {"maxRefills": max_refills},
    }
    return make_job(
        mode="sync",
        maxStaleness=0,
        workflow={
            "entrypoint": entrypoint,
            "args": {"vocab": 4, "symbols": 3, "policies": {"speaker": "agent", "listener": "agent"}},
        },
        training={"totalSteps": steps},
        policies=[policy(algorithm=algorithm)],
    )


def test_equal_reward_groups_are_dropped_and_replaced(ray_local: Any, tmp_path: Path) -> None:
    job = _job("polyrl_runtime.workflows.signal:SignalGame", max_refills=8, steps=3)
    _, summary = run(job, tmp_path)
    assert summary.state == "done", summary.message
    records = summary.records
    # A random listener guesses 1 symbol in 3: some groups are all wrong (or all right).
    assert sum(r.dropped["zero_variance"] for r in records) > 0
    for rec in records:
        # Dropped pairs gave their credit back: the step still trained on a full step of episodes
        # (two samples each; replacements come in whole groups).
        assert 2 * EPISODES <= rec.samples < 2 * (EPISODES + GROUP), rec
        assert rec.dropped["zero_variance"] % 2 == 0  # both agents' turns of a dropped episode


def test_past_the_cap_a_version_trains_on_equal_reward_groups(ray_local: Any, tmp_path: Path) -> None:
    job = _job("faulty_workflows:AlwaysTied", max_refills=1, steps=2)
    _, summary = run(job, tmp_path)
    assert summary.state == "done", summary.message
    for rec in summary.records:
        # One step's worth of episodes (16, two samples each) dropped, then the next 16 trained on.
        assert rec.dropped["zero_variance"] == 2 * EPISODES, rec
        assert rec.samples == 2 * EPISODES, rec
