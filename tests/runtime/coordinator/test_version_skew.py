"""spec.maxVersionSkew in the coordinator: the gate that holds a policy ahead back (onVersionSkew
wait), the starvation check of onVersionSkew drop, the per-step skew metrics, and a job with two
policies in every episode trained under the bound."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from polyrl_runtime.coordinator.job_state import PolicyRun
from polyrl_runtime.coordinator.metrics.records import RewardWindow
from polyrl_runtime.coordinator.starvation import Starvation
from polyrl_runtime.coordinator.version_skew import Laggard, SkewGate
from polyrl_runtime.experience import DropReason
from polyrl_runtime.experience.buffer import PolicyStats

from .driver_harness import make_job, policy, run


def runs(**steps: int) -> dict[str, PolicyRun]:
    return {n: PolicyRun(n, [], step=s) for n, s in steps.items()}


def test_a_policy_waits_only_when_its_next_step_would_take_it_over_the_bound() -> None:
    r = runs(a=5, b=4, c=6)
    gate = SkewGate(r, bound=2, total_steps=10)
    assert gate.holding("b") is None  # the slowest is never held back
    assert gate.holding("a") is None  # 6 against b's 4: two apart
    assert gate.holding("c") == Laggard("b", 4)  # 7 against 4
    r["b"].step = 5
    assert gate.holding("c") is None
    assert SkewGate(r, bound=None, total_steps=10).holding("c") is None  # no bound, or drop mode


def test_a_finished_or_ended_policy_holds_no_one_back() -> None:
    r = runs(a=10, b=2)
    gate = SkewGate(r, bound=1, total_steps=10)
    assert gate.holding("b") is None  # a finished at the last step
    r["a"].step = 3
    assert gate.holding("b") is None and gate.holding("a") == Laggard("b", 2)
    gate.ended("b")  # its loop is over (its data ran out, or the job stops)
    assert gate.holding("a") is None


def test_the_gate_waits_until_the_laggard_steps_and_says_whom_it_waits_for() -> None:
    async def scenario() -> list[dict[str, Any]]:
        r = runs(a=3, b=2)
        gate = SkewGate(r, bound=1, total_steps=10)
        with capture_logs() as logs:
            held = asyncio.create_task(gate.wait("a", asyncio.Event()))
            await asyncio.sleep(0.1)
            assert not held.done()
            r["b"].step = 3
            await asyncio.wait_for(held, 5)
        stop = asyncio.Event()
        stop.set()
        r["a"].step = 5
        await asyncio.wait_for(gate.wait("a", stop), 5)  # a stopping job is not held
        return logs

    (line,) = asyncio.run(scenario())
    assert line["event"] == "training.waits_for_version_skew"
    assert (line["policy"], line["waits_for"], line["its_step"], line["max_version_skew"]) == ("a", "b", 2, 1)


def stats(buffered: int = 0, leased: int = 0, skewed: int = 0, stale: int = 0) -> PolicyStats:
    dropped = {r.value: 0 for r in DropReason} | {
        DropReason.VERSION_SKEW.value: skewed,
        DropReason.STALE.value: stale,
    }
    return PolicyStats("a", 0, buffered, leased, 0, 0, 0, 0, 0, dropped, 0.0, 0, False)


def test_a_policy_starves_only_when_every_sample_is_dropped_for_the_whole_timeout() -> None:
    watch = Starvation(0.0)
    assert not watch.starved(stats(skewed=3), timeout_s=0.05)  # the first reading starts the clock
    assert not watch.starved(stats(skewed=5), timeout_s=60)  # dropping, but not for long
    assert watch.starved(stats(skewed=5), timeout_s=0.0)
    assert not watch.starved(stats(buffered=1, skewed=9), timeout_s=0.0)  # a sample arrived
    # engines that never get the trainer's weights: every sample arrives too stale, forever
    stale = Starvation(0.0)
    assert not stale.starved(stats(stale=4), timeout_s=0.0)
    assert stale.starved(stats(stale=12, skewed=1), timeout_s=0.0)
    assert stale.since(stats(stale=12, skewed=1)) == {"stale": 8, "version_skew": 1}
    quiet = Starvation(0.0)
    quiet.starved(stats(), timeout_s=0.0)
    assert not quiet.starved(stats(), timeout_s=0.0)  # nothing dropped: the stall check's business


def test_the_window_reports_each_steps_skew_per_other_policy_and_survives_a_checkpoint() -> None:
    window = RewardWindow(8)
    window.add(1.0, None, {"b": 1, "c": 0})
    window.add(0.0, None, {"b": 3})
    restored = RewardWindow(8)
    restored.restore(json.loads(json.dumps(window.state())))
    assert restored.take_skew() == window.take_skew() == {"b": (2.0, 3), "c": (0.0, 0)}
    assert window.take_skew() == {}


@pytest.mark.slow
def test_two_policies_of_every_episode_train_within_the_bound(ray_local: Any, tmp_path: Path) -> None:
    job = make_job(
        maxVersionSkew=1,
        training={"totalSteps": 3, "episodesPerStep": 8},
        workflow={
            "entrypoint": "polyrl_runtime.workflows.signal:SignalGame",
            "args": {"vocab": 4, "symbols": 3, "policies": {"speaker": "speaker", "listener": "listener"}},
        },
        policies=[policy("speaker"), policy("listener", trainer={"microBatchSize": 8})],
    )
    driver, summary = run(job, tmp_path)
    assert summary.state == "done", summary.message
    assert {r.policy: r.step for r in summary.records} == {"speaker": 3, "listener": 3}
    for rec in summary.records:
        other = "listener" if rec.policy == "speaker" else "speaker"
        assert set(rec.version_skew_max) == ({other} if rec.episodes else set()), rec
        if not rec.episodes:  # a step on samples of episodes reported before the previous one
            continue
        # the trainers stay within 1 version; a sample may lag its own by maxStaleness (1) more
        assert 0 <= rec.version_skew_mean[other] <= rec.version_skew_max[other] <= 2, rec
    (series,) = (tmp_path / "ckpt" / "metrics").glob("*.jsonl")
    rows = [json.loads(x) for x in series.read_text().splitlines()]
    assert len(rows) == 6 and any("version_skew_max_listener" in r for r in rows if r["policy"] == "speaker")
    progress = {p.name: p.version_skew for p in driver.progress().policies}
    assert set(progress) == {"speaker", "listener"} and all(v is not None for v in progress.values())
