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
import ray
from structlog.testing import capture_logs

from polyrl_runtime import storage
from polyrl_runtime.coordinator.checkpoints.checkpointer import Checkpointer
from polyrl_runtime.coordinator.checkpoints.store import CheckpointRef, CheckpointStore
from polyrl_runtime.coordinator.job_state import JobControl, PolicyRun
from polyrl_runtime.coordinator.metrics.records import StepRecord
from polyrl_runtime.coordinator.policy_restart import verdict
from polyrl_runtime.coordinator.pool_scheduler import device_pools
from polyrl_runtime.coordinator.report import RunSummary
from polyrl_runtime.experience.buffer import BufferSnapshot

from .driver_harness import make_job, new_driver, policy, run, until

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
        store.commit(tmp, {"step": step, "policies": {"a": entry, "b": {"step": step}}}, None)
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
    assert resumed["checkpoint"] is not None  # a checkpoint existed before the kill

    # the listener stepped while the speaker's trainer was restarting, unless the restart took
    # less than one of its steps
    assert any(restarting < t < restarted for t, r in records if r.policy == "listener") or (
        restarted - restarting < max(r.train_s + r.sync_s for r in listener)
    )

    progress = {p.name: p for p in d.progress().policies}
    assert progress["speaker"].trainer_state == "frozen" and progress["speaker"].restarts == 1
    assert progress["listener"].trainer_state == "done"
    assert progress["speaker"].version == versions[-1]

    # the final checkpoint holds the frozen speaker's trainer state, or names the one that does
    # (trainer_at: the speaker froze after the latest cut that saved it), which pruning keeps
    store = CheckpointStore(tmp_path / "ckpt", keep=1)
    latest = store.latest()
    assert latest is not None
    entry = latest.state["policies"]["speaker"]
    assert Path(latest.trainer_dir("speaker")).is_dir(), json.dumps(latest.state)
    assert entry["step"] <= after[-1].step, (entry, after[-1])
    # every sample is accounted for: produced == consumed + buffered + leased + dropped
    _accounted(summary)

    # a resume with more steps: each policy from its own entry, at different steps (the speaker
    # from the older checkpoint its entry names), a fresh restart budget for the frozen one
    more = job.model_copy(deep=True)
    more.spec.training.total_steps = 8
    _, resumed_run = run(more, tmp_path)
    assert resumed_run.state == "done", resumed_run.message
    again = {n: [r.step for r in resumed_run.records if r.policy == n] for n in ("speaker", "listener")}
    assert again["listener"] == [7, 8] and again["speaker"] == list(range(entry["step"] + 1, 9)), again
    first = next(r for r in resumed_run.records if r.policy == "speaker")
    assert first.version > entry["version"], (first, entry)
    _accounted(resumed_run)


def _accounted(summary: RunSummary) -> None:
    for name, b in summary.buffers.items():
        dropped = sum(summary.dropped[name].values())
        assert b["produced"] == b["consumed"] + b["buffered"] + b["leased"] + dropped, (name, b)


class _Rank:
    """A trainer rank's `save` as it reaches the store (storage.staged_dir); `dies`: its actor is
    lost partway, after writing part of its state."""

    def __init__(self) -> None:
        self.dies = False

    async def save(self, directory: str, tag: str) -> None:
        with storage.staged_dir(directory) as local:
            (local / tag).mkdir()
            (local / tag / "model.pt").write_bytes(b"w" * 100)
            if self.dies:
                raise ray.exceptions.RayActorError()


class _Buffer:
    async def snapshot(self) -> BufferSnapshot:
        return BufferSnapshot((), 1, {}, {}, {}, False)


def _root(where: str, tmp_path: Path, request: pytest.FixtureRequest) -> Path | str:
    return tmp_path / "ckpt" if where == "file" else f"s3://{request.getfixturevalue('bucket')}/job"


def _checkpointer(
    root: Path | str, total: int, keep: int, runs: dict[str, PolicyRun]
) -> tuple[CheckpointStore, Checkpointer]:
    """A job of `runs`' policies checkpointing every 2 steps into `root`, its buffer a stand-in."""
    job = make_job(
        training={"totalSteps": total},
        checkpoint={"everySteps": 2, "keep": keep},
        policies=[policy(n) for n in runs],
    )
    store = CheckpointStore(root, keep=keep)
    pools = device_pools(job.spec, engines=lambda p: [], ranks=lambda p: [])
    ckpt = Checkpointer(job, store, JobControl(None), runs, None, pools=pools)
    ckpt.attach(_Buffer(), dict, lambda: None)  # type: ignore[arg-type]
    return store, ckpt


@pytest.mark.parametrize("where", ["file", "s3"])
def test_a_rank_lost_mid_checkpoint_abandons_it_and_the_previous_one_stays_the_latest(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    root = _root(where, tmp_path, request)
    ranks = {"a": _Rank(), "b": _Rank()}
    runs = {n: PolicyRun(n, [r], step=2) for n, r in ranks.items()}  # type: ignore[list-item]
    store, ckpt = _checkpointer(root, 10, 2, runs)

    async def scenario() -> None:
        await ckpt.maybe_checkpoint()  # step 2, complete
        for r in runs.values():
            r.step = 4
        ranks["a"].dies = True
        with capture_logs() as logs:
            await ckpt.maybe_checkpoint()  # step 4: a's rank is lost while it saves
        assert [e["policy"] for e in logs if e["event"] == "checkpoint.abandoned"] == ["a"], logs
        latest = store.latest()
        assert latest is not None and latest.step == 2 and ckpt.latest_with("a") == latest
        assert storage.list_names(latest.trainer_dir("a")) == ["ckpt"]  # what a restart loads
        ranks["a"].dies = False
        for r in runs.values():
            r.step = 6
        await ckpt.maybe_checkpoint()  # complete again; the abandoned one is pruned

    asyncio.run(scenario())
    assert [r.step for r in store.all()] == [2, 6]
    assert sorted(storage.list_names(str(root))) == ["step-000002", "step-000006"]


@pytest.mark.parametrize("where", ["file", "s3"])
def test_a_policy_ahead_of_the_others_restarts_from_its_own_restart_point(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    root = _root(where, tmp_path, request)
    runs = {n: PolicyRun(n, [_Rank()], step=2) for n in ("a", "b")}  # type: ignore[list-item]
    store, ckpt = _checkpointer(root, 20, 1, runs)
    a, b = runs["a"], runs["b"]

    async def scenario() -> None:
        await ckpt.maybe_checkpoint()  # both at step 2: the job's checkpoint
        a.step = 3
        await ckpt.maybe_restart_point(a)  # one of its steps past the checkpoint: nothing yet
        assert store.restart_points() == []
        a.step = 4  # b is still at 2, so the job's next checkpoint waits for it
        await ckpt.maybe_checkpoint()
        await ckpt.maybe_restart_point(a)
        own = ckpt.latest_with("a")
        assert own is not None and own.name == "policy-a-step-000004" and own.step == 4
        assert storage.list_names(own.trainer_dir("a")) == ["ckpt"]  # what a restart of a loads
        assert ckpt.latest_with("b") == store.latest()  # b has none: its entry in the checkpoint
        a.step = 6
        await ckpt.maybe_restart_point(a)
        assert [p.name for p in store.restart_points()] == ["policy-a-step-000006"]  # 4 is pruned
        b.step = 3
        await ckpt.maybe_restart_point(b)  # the slowest: the job's next checkpoint is at its pace
        assert [p.name for p in store.restart_points()] == ["policy-a-step-000006"]
        # a's trainer is down (frozen): the next checkpoint carries its entry, naming its restart
        # point, which pruning then keeps
        a.trainer_state = "frozen"
        b.step = 4
        await ckpt.maybe_checkpoint()

    asyncio.run(scenario())
    latest = store.latest()
    assert latest is not None and latest.step == 4
    entry = latest.state["policies"]["a"]
    assert (entry["step"], entry["trainer_at"]) == (6, "policy-a-step-000006"), latest.state
    assert storage.list_names(latest.trainer_dir("a")) == ["ckpt"]
    assert sorted(storage.list_names(str(root))) == ["policy-a-step-000006", "step-000004"]
    # A new attempt resumes from the job's checkpoints: restart points that none names are dropped.
    leftover = store.begin(9, policy="b")
    store.commit(leftover, {"step": 9, "policies": {"b": {"step": 9}}}, None)
    assert len(store.restart_points()) == 2
    _checkpointer(root, 20, 1, runs)  # a new attempt's
    assert [p.name for p in store.restart_points()] == ["policy-a-step-000006"]


def test_a_job_of_one_policy_takes_no_restart_points(tmp_path: Path) -> None:
    job = make_job(training={"totalSteps": 20}, checkpoint={"everySteps": 2, "keep": 1})
    store = CheckpointStore(tmp_path, keep=1)
    run_ = PolicyRun("agent", [_Rank()], step=6)  # type: ignore[list-item]
    pools = device_pools(job.spec, engines=lambda p: [], ranks=lambda p: [])
    ckpt = Checkpointer(job, store, JobControl(None), {"agent": run_}, None, pools=pools)
    asyncio.run(ckpt.maybe_restart_point(run_))
    assert store.restart_points() == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["file", "s3"])
def test_a_restart_point_being_written_survives_another_policys_commit(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store = CheckpointStore(_root(where, tmp_path, request), keep=1)
    writing = store.begin(4, policy="a")  # a's ranks are saving into it
    with storage.staged_dir(storage.join(writing, "trainers", "a")) as d:
        (d / "ckpt").mkdir()
        (d / "ckpt" / "model.pt").write_bytes(b"w")
    done = store.begin(6, policy="b")
    store.commit(done, {"step": 6, "policies": {"b": {"step": 6}}}, None)  # prunes: a's stays
    assert storage.list_names(storage.join(writing, "trainers", "a")) == ["ckpt"]
    store.commit(writing, {"step": 4, "policies": {"a": {"step": 4}}}, None)
    assert [p.name for p in store.restart_points()] == ["policy-a-step-000004", "policy-b-step-000006"]
    # one abandoned (its rank was lost) is a leftover for the next prune
    lost = store.begin(8, policy="a")
    store.abandon(lost)
    store.prune()
    assert not storage.exists(lost) or storage.list_names(lost) == []
