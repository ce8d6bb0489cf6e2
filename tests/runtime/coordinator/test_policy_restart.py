"""One policy's trainer failing stays that policy's (coordinator/policy_restart.py): its trainer
restarts alone from its latest checkpoint, then, out of restarts, the policy freezes while the
other trains on."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from polyrl_runtime.coordinator.checkpoints.store import CheckpointRef, CheckpointStore
from polyrl_runtime.coordinator.job_state import PolicyRun
from polyrl_runtime.coordinator.metrics.records import StepRecord
from polyrl_runtime.coordinator.policy_restart import verdict
from polyrl_runtime.coordinator.report import RunSummary

from .driver_harness import make_job, new_driver, policy, until

SIGNAL = {
    "entrypoint": "polyrl_runtime.workflows.signal:SignalGame",
    "args": {"vocab": 4, "symbols": 3, "policies": {"speaker": "speaker", "listener": "listener"}},
}


class _Fleet:
    colocated: frozenset[str] = frozenset()
    shared_trainers: ClassVar[dict[str, tuple[str, ...]]] = {}


@pytest.mark.parametrize(
    ("own", "job", "restarts", "action"),
    [
        (None, {}, 0, "restart"),  # the job's default: 3 restarts, then failJob
        (None, {}, 3, "fail"),
        ({"maxRestarts": 5}, {}, 3, "restart"),  # the policy's own limit wins
        ({"maxRestarts": 0}, {"onPolicyFailure": "freeze"}, 0, "freeze"),
        ({"onPolicyFailure": "failJob"}, {"maxRestarts": 1, "onPolicyFailure": "freeze"}, 1, "fail"),
    ],
)
def test_the_verdict_follows_the_policys_limits_over_the_jobs(
    own: dict[str, Any] | None, job: dict[str, Any], restarts: int, action: str
) -> None:
    spec = make_job(
        failurePolicy=job,
        policies=[policy("speaker", **({"failurePolicy": own} if own else {})), policy("listener")],
    ).spec
    run = PolicyRun("speaker", [], step=4, restarts=restarts)
    v = verdict(spec, _Fleet(), run, RuntimeError("rank 0 lost"))  # type: ignore[arg-type]
    assert v.action == action, v
    assert "policy speaker: trainer failed at step 5: RuntimeError: rank 0 lost" in v.message
    assert v.retryable == (action != "fail")


def test_a_trainer_that_shares_its_process_fails_the_job_to_restart_it() -> None:
    spec = make_job(policies=[policy("speaker"), policy("listener")]).spec
    fleet = _Fleet()
    fleet.colocated = frozenset({"speaker"})
    v = verdict(spec, fleet, PolicyRun("speaker", []), RuntimeError("x"))  # type: ignore[arg-type]
    assert (v.action, v.retryable) == ("fail", True)
    assert "shares a process with its first engine" in v.message


def test_a_frozen_policys_trainer_state_is_kept_where_a_later_checkpoint_points(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    for step, entry in ((2, {"step": 2}), (4, {"step": 2, "trainer_at": "step-000002"})):
        tmp = store.begin(step)
        (Path(tmp) / "trainers" / "a").mkdir(parents=True)
        store.commit(tmp, {"step": step, "policies": {"a": entry, "b": {"step": step}}}, None)  # type: ignore[arg-type]
    latest = store.latest()
    assert latest is not None and latest.step == 4
    assert [r.step for r in store.all()] == [2, 4]  # pruning keeps the one step 4 points at
    assert latest.trainer_dir("a") == str(tmp_path / "step-000002" / "trainers" / "a")
    assert latest.trainer_dir("b") == str(tmp_path / "step-000004" / "trainers" / "b")
    assert CheckpointRef(str(tmp_path / "step-000004"), latest.state).name == "step-000004"


@pytest.mark.slow
def test_a_trainer_killed_twice_restarts_alone_then_freezes_while_the_other_trains_on(
    ray_local: Any, tmp_path: Path
) -> None:
    job = make_job(
        training={"totalSteps": 6, "episodesPerStep": 8},
        workflow=SIGNAL,
        checkpoint={"everySteps": 2, "keep": 1},
        failurePolicy={"onPolicyFailure": "freeze"},
        policies=[
            policy("speaker", failurePolicy={"maxRestarts": 1}),
            policy("listener", trainer={"microBatchSize": 8}),
        ],
    )
    events: list[tuple[float, str, dict[str, Any]]] = []
    records: list[tuple[float, StepRecord]] = []
    d = new_driver(
        job,
        tmp_path,
        on_event=lambda kind, data: events.append((time.monotonic(), kind, data)),
        on_record=lambda rec: records.append((time.monotonic(), rec)),
    )

    async def scenario() -> RunSummary:
        task = asyncio.create_task(d.run())
        ready = lambda: "speaker" in d.runs and d.runs["speaker"].step >= 3 and d.last_ckpt is not None  # noqa: E731
        await until(task, ready, "speaker's step 3 and a checkpoint")
        speaker = d.runs["speaker"]
        speaker.ranks[0].kill()  # restarts from its part of the latest checkpoint
        await until(task, lambda: speaker.restarts == 1 and speaker.trainer_state == "training", "a restart")
        resumed = speaker.step
        await until(task, lambda: speaker.step > resumed, "a step after the restart")
        speaker.ranks[0].kill()  # out of restarts: frozen
        return await task

    summary = asyncio.run(scenario())
    assert summary.state == "done", summary.message
    assert "speaker (frozen)" in summary.message, summary.message
    kinds = [k for _, k, _ in events]
    assert kinds.count("policy_restarting") == 1 and kinds.count("policy_frozen") == 1, kinds

    listener = [r for _, r in records if r.policy == "listener"]
    assert [r.step for r in listener] == list(range(1, 7))  # the listener trained to the end
    # the speaker went back to the step its checkpoint held (losing the steps since), and its
    # versions never went back: the restart published the checkpoint's weights as a new version
    restarting = next(t for t, k, _ in events if k == "policy_restarting")
    restarted, resumed = next((t, data) for t, k, data in events if k == "policy_restarted")
    before = [r for t, r in records if r.policy == "speaker" and t < restarting]
    after = [r for t, r in records if r.policy == "speaker" and t > restarted]
    assert after and after[0].step == resumed["step"] + 1 <= before[-1].step + 1, (before, after)
    assert resumed["version"] == before[-1].version + 1 and after[0].version == resumed["version"] + 1
    versions = [r.version for r in before + after]
    assert versions == sorted(set(versions)), versions
    checkpointed = json.loads((Path(resumed["checkpoint"]) / "state.json").read_text())
    assert checkpointed["policies"]["speaker"]["step"] == resumed["step"]

    # the listener stepped while the speaker's trainer was restarting, unless the restart took
    # less than one of its steps
    assert any(restarting < t < restarted for t, r in records if r.policy == "listener") or (
        restarted - restarting < max(r.train_s + r.sync_s for r in listener)
    )

    progress = {p.name: p for p in d.progress().policies}
    assert progress["speaker"].trainer_state == "frozen" and progress["speaker"].restarts == 1
    assert progress["listener"].trainer_state == "done"
    assert progress["speaker"].version == versions[-1]

    # the final checkpoint points at the one holding the frozen speaker's trainer, and keeps it
    store = CheckpointStore(tmp_path / "ckpt", keep=1)
    latest = store.latest()
    assert latest is not None
    entry = latest.state["policies"]["speaker"]
    assert (tmp_path / "ckpt" / entry["trainer_at"] / "trainers" / "speaker").is_dir(), json.dumps(
        latest.state
    )
    # its entry is that checkpoint's: a resume restarts it from the step its trainer state holds
    held = next(r for r in store.all() if r.name == entry["trainer_at"])
    assert entry["step"] == held.state["policies"]["speaker"]["step"] < after[-1].step, json.dumps(
        latest.state
    )
    # every sample is accounted for: produced == consumed + buffered + leased + dropped
    for name, b in summary.buffers.items():
        dropped = sum(summary.dropped[name].values())
        assert b["produced"] == b["consumed"] + b["buffered"] + b["leased"] + dropped, (name, b)
