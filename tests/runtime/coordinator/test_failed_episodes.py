"""Episodes that fail: a sync step still trains on its full episodesPerStep (failed episodes are
replaced by new groups), nothing is generated only to be dropped as stale, and the metrics give each
counter per step and as a running total."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from driver_harness import make_job, run

from polyrl_runtime.coordinator.metrics.files import read_metrics

pytestmark = pytest.mark.slow

EPISODES, GROUP = 16, 4  # selfplay-tiny.yaml: episodesPerStep, groupSize


def test_episodes_a_policy_made_fail_are_counted_and_trained_on(ray_local: Any, tmp_path: Path) -> None:
    job = make_job(
        mode="sync",
        maxStaleness=0,
        workflow={"entrypoint": "faulty_workflows:PolicyFailsAFraction", "failureReward": -1.0},
        training={"totalSteps": 2},
    )
    _, summary = run(job, tmp_path)
    assert summary.state == "done", summary.message
    assert summary.failed.get("policy_failure", 0) > 0 and "workflow_error" not in summary.failed
    for rec in summary.records:
        # Penalised episodes are not replaced: exactly episodesPerStep, each trained on.
        assert rec.episodes == EPISODES and rec.samples == 2 * rec.episodes, rec
    # Their -1 is in the policies' rewards (every finished episode of this game scores 0 or 1).
    assert min(r.reward_mean for r in summary.records) < 1.0


def test_a_sync_step_trains_on_full_episodes_per_step_whatever_fails(ray_local: Any, tmp_path: Path) -> None:
    job = make_job(
        mode="sync",
        maxStaleness=0,
        workflow={"entrypoint": "faulty_workflows:FailsAFraction"},
        training={"totalSteps": 4},
    )
    _, summary = run(job, tmp_path)
    assert summary.state == "done", summary.message
    failed = sum(summary.failed.values())
    assert summary.failed["workflow_error"] == failed > 0
    records = summary.records
    assert [r.step for r in records] == [1, 2, 3, 4]
    for rec in records:
        # Never short; at most one replacement group's worth over (replacements come in whole groups).
        assert EPISODES <= rec.episodes < EPISODES + GROUP, rec
        assert rec.samples == 2 * rec.episodes  # every finished episode of the step trained on
        assert rec.staleness_max == 0
        assert rec.dropped == {
            "stale": 0,
            "policy_finished": 0,
            "job_cancelled": 0,
            "version_skew": 0,
            "policy_restarting": 0,
            "policy_frozen": 0,
            "zero_variance": 0,
            "overlong": 0,
        }
    # Nothing generated only to be dropped, during the run or at its end.
    assert summary.dropped["agent"] == {
        "stale": 0,
        "policy_finished": 0,
        "job_cancelled": 0,
        "version_skew": 0,
        "policy_restarting": 0,
        "policy_frozen": 0,
        "zero_variance": 0,
        "overlong": 0,
    }
    assert any(r.failed_episodes for r in records)
    # Per step: the episodes that failed since the step before (a sync step's episodes are all in
    # when it trains, and none start after the last one).
    assert sum(r.failed_episodes for r in records) == failed
    assert [r.failed_episodes_total for r in records] == [
        sum(r.failed_episodes for r in records[: i + 1]) for i in range(len(records))
    ]
    rows = read_metrics(tmp_path / "ckpt" / "metrics")
    assert [row["failed_episodes"] for row in rows] == [r.failed_episodes for r in records]
    assert rows[-1]["failed_episodes_total"] == failed
    assert all(row["dropped_stale"] == row["dropped_stale_total"] == 0 for row in rows)


def test_a_sync_job_whose_workflow_always_fails_ends_with_the_episode_error(
    ray_local: Any, tmp_path: Path
) -> None:
    job = make_job(mode="sync", maxStaleness=0, workflow={"entrypoint": "faulty_workflows:AlwaysFails"})
    _, summary = run(job, tmp_path, max_consecutive_failures=8)
    assert summary.state == "failed"
    assert "episodes in a row failed" in summary.message, summary.message
    assert "reward function divided by zero" in summary.message and "episode g" in summary.message
    assert summary.steps == {"agent": 0}


def test_async_drops_are_reported_per_step_and_in_total(ray_local: Any, tmp_path: Path) -> None:
    _, summary = run(make_job(training={"totalSteps": 4}), tmp_path)
    assert summary.state == "done", summary.message
    records = summary.records
    for reason in ("stale", "policy_finished", "job_cancelled"):
        totals = [r.dropped_total[reason] for r in records]
        assert totals == [sum(r.dropped[reason] for r in records[: i + 1]) for i in range(len(records))]
        assert totals[-1] <= summary.dropped["agent"][reason]  # drops after the last step come later


def test_a_timed_out_episodes_requests_are_aborted_and_counted(ray_local: Any, tmp_path: Path) -> None:
    """Episodes that generate until a 2 s timeout stops them: each has a request still generating
    then (its first one was sent long before, however loaded the machine), which the engine stops;
    the run counts them with the tokens they did not generate."""
    job = make_job(
        mode="sync",
        maxStaleness=0,
        workflow={
            "entrypoint": "faulty_workflows:Rambles",
            "args": {"vocab": 4, "symbols": 3, "policies": {"speaker": "agent", "listener": "agent"}},
            "episodeTimeoutSeconds": 2.0,
        },
        training={"totalSteps": 1},
    )
    _, summary = run(job, tmp_path, max_consecutive_failures=8)
    assert summary.state == "failed" and "(timeout)" in summary.message, summary.message
    assert summary.failed.get("timeout", 0) >= 8, summary.failed
    aborted = summary.aborted["agent"]
    assert aborted["requests"] > 0 and aborted["freed_tokens"] > 0, aborted
