"""The driver end to end on a local Ray: sync/async staleness, checkpoint/resume, drain and
/progress over HTTP, failing workflows, a dying engine, ZeRO-3 with two ranks and PPO with KL."""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
from driver_harness import make_job, new_driver, policy, run, still_running, until

from polyrl_operator.api import RLJob
from polyrl_operator.api.progress import Progress
from polyrl_runtime.actors import Actor
from polyrl_runtime.coordinator.checkpoints.store import BUFFER, CheckpointStore
from polyrl_runtime.coordinator.driver import Driver
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.progress_server import ProgressServer
from polyrl_runtime.coordinator.report import RunSummary
from polyrl_runtime.coordinator.slots import Slot
from polyrl_testenv.rayactors import gone

pytestmark = pytest.mark.slow


def test_sync_mode_trains_strictly_on_policy(ray_local: Any, tmp_path: Path) -> None:
    _, summary = run(make_job(mode="sync", maxStaleness=0), tmp_path)
    assert summary.state == "done", summary.message
    assert summary.steps == {"agent": 3} and len(summary.records) == 3
    for rec in summary.records:
        assert rec.staleness_max == 0
        # behaviour logprobs (engine) == proximal logprobs (trainer): importance weight exactly 1
        assert rec.is_weight_mean == pytest.approx(1.0, abs=1e-3)
        assert rec.samples == 16 * 2  # 16 episodes per step, speaker + listener turn each
        # the entropy of the sampled distributions (over each turn's allowed ids) is always reported
        assert 0.0 < rec.entropy <= math.log(4) + 1e-6  # at most 4 allowed ids (vocab: 4)
    assert summary.dropped["agent"]["stale"] == 0
    assert summary.first_reward["agent"] is not None


@pytest.mark.parametrize("colocate", [False, True], ids=["separate", "colocated"])
def test_async_mode_overlaps_and_bounds_staleness(ray_local: Any, tmp_path: Path, colocate: bool) -> None:
    # Colocated: the trainer's step runs on its threads while the engine in the same process generates.
    driver, summary = run(make_job(training={"totalSteps": 4}), tmp_path, colocate=colocate)
    assert summary.state == "done", summary.message
    assert driver.fleet.colocated == ({"agent"} if colocate else set())
    lags = [r.staleness_max for r in summary.records]
    assert max(lags) <= 1  # maxStaleness
    assert max(lags) == 1  # generation really ran ahead of training
    dropped = summary.dropped["agent"]
    if dropped["stale"] == 0:  # else credit came back mid-run, and a short step may leave samples
        # Credit stops at the last step's episodes, and nothing starts once the policy is done: before,
        # the last maxStaleness steps' worth of episodes were generated and then dropped.
        assert dropped["policy_finished"] == 0, dropped
    ckpts = CheckpointStore(tmp_path / "ckpt", keep=2).all()
    assert [c.step for c in ckpts] == [2, 4]  # everySteps 2, keep 2, final at 4


def test_checkpoint_then_resume_continues_counters_and_experience(ray_local: Any, tmp_path: Path) -> None:
    _, first = run(make_job(training={"totalSteps": 2}, checkpoint={"everySteps": 1, "keep": 3}), tmp_path)
    assert first.state == "done"
    latest = CheckpointStore(tmp_path / "ckpt", 3).latest()
    assert latest is not None and latest.step == 2
    leftover = sum(len(v) for v in latest.buffer().samples.values())
    produced = latest.buffer().policies["agent"]["produced"]
    driver, second = run(
        make_job(training={"totalSteps": 4}, checkpoint={"everySteps": 1, "keep": 3}), tmp_path
    )
    assert second.state == "done", second.message
    assert [r.step for r in second.records] == [3, 4]
    assert second.episodes > first.episodes  # counters continue from the checkpoint
    final = CheckpointStore(tmp_path / "ckpt", 3).latest()  # the buffer's counters at the end
    assert final is not None and final.step == 4
    counts = final.buffer().policies["agent"]
    assert counts["produced"] > produced
    # unconsumed experience of the first run was restored, not lost: trained or dropped with a reason
    buffered = sum(len(v) for v in final.buffer().samples.values())
    assert counts["consumed"] + sum(counts["dropped"].values()) + buffered >= leftover
    # A request that arrives once the run has ended (its actors are stopped) is answered by the
    # final checkpoint, which holds everything the job trained.
    answer = asyncio.run(driver.checkpoint("manual", "late-1"))
    assert answer is not None and answer.step == 4 and "late-1" in driver.handled_requests


def test_a_policy_that_can_never_get_credit_fails_the_job_instead_of_hanging(
    ray_local: Any, tmp_path: Path
) -> None:
    """The safety net behind the buffer's credit accounting: a resumed buffer whose accounts say every
    credit is taken (as the finished-policy bug left them) must end the job with a clear reason."""
    _, first = run(make_job(training={"totalSteps": 1}), tmp_path)
    assert first.state == "done", first.message
    ref = CheckpointStore(tmp_path / "ckpt", 2).latest()
    assert ref is not None
    snap = ref.buffer()
    snap.policies["agent"]["admitted"] = 10**6
    (ref.path / BUFFER).write_bytes(pickle.dumps(snap))
    driver, second = run(make_job(training={"totalSteps": 3}), tmp_path, stall_timeout_s=2.0)
    assert second.state == "failed" and not driver.retryable
    assert "policy agent: stalled at step 1: no staleness credit" in second.message, second.message


def test_an_unexpected_error_in_a_training_loop_fails_the_job_naming_it(
    ray_local: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A periodic checkpoint that cannot be written (here: the store raises) is an error in the
    training loop that runs it. It fails the job, retryably and with the error; before, the loop's
    task ended with the exception unread and the run returned as if interrupted."""
    driver = new_driver(
        make_job(training={"totalSteps": 3}, checkpoint={"everySteps": 1, "keep": 2}), tmp_path
    )

    def full(step: int) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(driver.store, "begin", full)
    summary = asyncio.run(driver.run())
    assert summary.state == "failed" and driver.retryable
    assert (
        "policy agent: training loop failed: OSError: [Errno 28] No space left on device" in summary.message
    )


def test_a_policy_the_workflow_never_calls_fails_the_job_clearly(ray_local: Any, tmp_path: Path) -> None:
    """Resume after adding a policy: it starts from its model (it is not in the checkpoint). The
    workflow's agents all map to `agent`, so `idle` would wait for samples forever; the job fails
    with a reason naming it instead."""
    _, first = run(make_job(training={"totalSteps": 1}), tmp_path)
    assert first.state == "done", first.message
    job = make_job(training={"totalSteps": 3}, policies=[policy(), policy("idle")])
    driver, second = run(job, tmp_path, unused_episodes=40)
    assert second.state == "failed" and not driver.retryable
    assert "policy idle: no agent turn of it in the last 40 episodes" in second.message, second.message
    assert second.steps["idle"] == 0


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _engine(doc: dict[str, Any], pod: str) -> dict[str, Any]:
    return next(e for e in doc["policies"][0]["engines"] if e["pod"] == pod)


def test_drain_progress_and_checkpoint_request_over_http(ray_local: Any, tmp_path: Path) -> None:
    # Steps to spare: the drain is seen over HTTP a few polls after it is asked for (steps 4-6 of 8
    # on a quiet machine), and the job must still be running then, and when the request is handled.
    steps = 24
    job = make_job(
        training={"totalSteps": steps}, policies=[policy(rollout={"replicas": {"min": 2, "max": 2}})]
    )
    driver = new_driver(job, tmp_path)
    seen: dict[str, Any] = {}

    async def scenario() -> Any:
        server = ProgressServer(driver, "127.0.0.1", 0)
        port = await server.start()
        base = f"http://127.0.0.1:{port}"
        task = asyncio.create_task(driver.run())
        await until(task, lambda: driver.state == "running" and driver.runs["agent"].step >= 2, "step 2")
        doc = await asyncio.to_thread(_get, base + "/progress")
        Progress.model_validate(doc)
        seen["running"] = doc
        target = doc["policies"][0]["engines"][0]["pod"]
        assert (await asyncio.to_thread(_post, base + "/drain", {"target": target}))["found"]
        # The operator's view over HTTP: the engine is reported drained once its work is done.
        while not _engine(await asyncio.to_thread(_get, base + "/progress"), target)["drained"]:
            still_running(task, "the drain")
            await asyncio.sleep(0.1)
        engine = driver.fleet.engines["agent"][target].actor
        seen["requests_at_drain"] = (await engine.stats()).requests
        await asyncio.to_thread(_post, base + "/checkpoint", {"requestId": "suspend-1"})
        await until(task, lambda: "suspend-1" in driver.handled_requests, "the checkpoint request")
        seen["after_request"] = await asyncio.to_thread(_get, base + "/progress")
        later = driver.runs["agent"].step + 2
        await until(task, lambda: driver.runs["agent"].step >= later, "two more steps")
        seen["requests_later"] = (await engine.stats()).requests  # still running: it answers
        summary = await task
        seen["gone_at_end"] = await asyncio.to_thread(gone, engine.handle)
        seen["final"] = await asyncio.to_thread(_get, base + "/progress")
        await server.stop()
        return summary

    summary = asyncio.run(scenario())
    assert summary.state == "done", summary.message
    # everySteps 2: the step-2 checkpoint may be under way when /progress is read (only entered from running)
    assert seen["running"]["state"] in ("running", "checkpointing") and seen["running"]["schemaVersion"] == 1
    assert seen["requests_later"] == seen["requests_at_drain"]  # no work after the drain
    assert seen["gone_at_end"]  # the driver stopped its actors as it returned
    assert seen["after_request"]["checkpoint"]["lastRequestId"] == "suspend-1"
    assert seen["after_request"]["checkpoint"]["lastStep"] >= 2
    assert seen["final"]["state"] == "done"
    assert seen["final"]["policies"][0]["step"] == steps


def test_a_workflow_that_always_raises_fails_the_job_clearly(ray_local: Any, tmp_path: Path) -> None:
    job = make_job(workflow={"entrypoint": "faulty_workflows:AlwaysFails"})
    _, summary = run(job, tmp_path, max_consecutive_failures=8)
    assert summary.state == "failed"
    assert (
        "episodes in a row failed" in summary.message and "reward function divided by zero" in summary.message
    )
    assert "episode g" in summary.message  # names the episode
    assert summary.failed["workflow_error"] >= 8


def test_occasional_episode_failures_are_counted_and_the_run_continues(
    ray_local: Any, tmp_path: Path
) -> None:
    job = make_job(workflow={"entrypoint": "faulty_workflows:SometimesFails"}, training={"totalSteps": 2})
    _, summary = run(job, tmp_path)
    assert summary.state == "done", summary.message
    assert summary.failed["workflow_error"] > 0 and summary.steps == {"agent": 2}


def test_an_entrypoint_that_cannot_be_imported_is_not_retryable(ray_local: Any, tmp_path: Path) -> None:
    driver, summary = run(make_job(workflow={"entrypoint": "no_such_package.games:Game"}), tmp_path)
    assert summary.state == "failed" and not driver.retryable
    assert "spec.workflow.entrypoint" in summary.message and "no_such_package" in summary.message
    assert driver.progress().retryable is False


# The timeout is a hang guard, not a performance bound: a collective group with a dead member used
# to hold the survivors for gloo's 600 s timeout; the run takes about 15 s.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["objectstore", "collective"])
def test_an_engine_that_dies_mid_run_does_not_stop_the_job(
    ray_local: Any, tmp_path: Path, transport: str
) -> None:
    job = make_job(
        training={"totalSteps": 6},
        weightSync={"transport": transport},
        policies=[policy(rollout={"replicas": {"min": 2, "max": 2}})],
    )
    rerouted: list[bool] = []
    driver, summary, events, victim = _kill_at_step_two(
        job, tmp_path, lambda fleet: next(iter(fleet.engines["agent"].values())), rerouted=rerouted
    )
    assert summary.state == "done", summary.message
    assert summary.steps == {"agent": 6}
    # Reported once, whichever part saw it die first (the weight sync, a worker or the poll), even
    # when the job ends before the next housekeeping round; and out of the sync group at once.
    lost = [data for kind, data in events if kind == "engine_lost"]
    assert lost == [{"engine": victim, "policy": "agent"}]
    assert victim not in driver.runs["agent"].sync.engines  # type: ignore[union-attr]
    # and every workflow worker came to hold the newest routing table, which leaves it out
    assert victim not in driver.fleet.routes()["agent"]
    assert rerouted == [True]


@pytest.mark.timeout(300)
def test_a_workflow_worker_that_dies_is_replaced_and_its_episodes_are_released(
    ray_local: Any, tmp_path: Path
) -> None:
    # The job's only workflow worker: before its replacement, the job hung with credit to spare
    # and no worker to run an episode on.
    job = make_job(training={"totalSteps": 6})

    def only_worker(fleet: Fleet) -> Slot[Actor]:
        assert len(fleet.workers) == 1
        return next(iter(fleet.workers.values()))

    _, summary, events, victim = _kill_at_step_two(job, tmp_path, only_worker)
    assert summary.state == "done", summary.message
    assert summary.steps == {"agent": 6}
    lost = [data for kind, data in events if kind == "worker_lost"]
    added = [data["worker"] for kind, data in events if kind == "worker_added"]
    assert lost == [{"worker": victim}] and len(added) == 1 and added[0] != victim
    # The episodes it held were released (their credit came back, so every step was full), and
    # none of its leases is left open.
    assert [r.samples for r in summary.records] == [16 * 2] * 6  # 16 episodes of two turns
    assert summary.buffers["agent"]["consumed"] == 6 * 16 * 2 and summary.buffers["agent"]["leased"] == 0


def test_zero3_two_ranks_ppo_with_kl_and_entropy(ray_local: Any, tmp_path: Path) -> None:
    p = policy(
        algorithm={"name": "ppo", "groupSize": 1, "lr": 1e-3, "klCoef": 0.1, "entropyCoef": 0.01},
        trainer={"zeroStage": 3, "replicas": 2, "microBatchSize": 4},
    )
    job = make_job(
        mode="sync", maxStaleness=0, training={"totalSteps": 2, "episodesPerStep": 8}, policies=[p]
    )
    driver, summary = run(job, tmp_path)
    assert summary.state == "done", summary.message
    assert all(r.samples == 16 for r in summary.records)  # 8 episodes x 2 turns, over two ranks
    assert any(r.kl > 0 for r in summary.records)  # later minibatches moved away from the reference
    assert all(r.entropy > 0 for r in summary.records)  # sampled turns: the entropy is reported
    # the engines serve the version the (gathered) ZeRO-3 weights were published as
    assert [e.version for e in driver.progress().policies[0].engines] == [2]
    engine = next(iter(driver.fleet.engines["agent"].values()))
    assert driver.parts is not None
    # every actor it started is stopped as `run` returns, not left to the garbage collector
    for actor in (engine.actor, driver.parts.buffer, *driver.runs["agent"].ranks):
        assert gone(actor.handle), f"{actor} still answers 30 s after the run returned"


Events = list[tuple[str, dict[str, Any]]]


def _kill_at_step_two(
    job: RLJob,
    tmp_path: Path,
    pick: Callable[[Fleet], Slot[Actor]],
    *,
    rerouted: list[bool] | None = None,
) -> tuple[Driver, RunSummary, Events, str]:
    """Run `job`, kill the actor `pick` chooses once step 2 is trained, and run on to the end.
    With `rerouted`, also wait (while the job runs: its actors stop with it) for the routing table
    to leave the victim out, and append whether every live workflow worker then holds it."""
    events: Events = []
    driver = new_driver(job, tmp_path, on_event=lambda kind, data: events.append((kind, data)))
    victim: list[str] = []

    async def scenario() -> RunSummary:
        task = asyncio.create_task(driver.run())
        await until(task, lambda: "agent" in driver.runs and driver.runs["agent"].step >= 2, "step 2")
        fleet = driver.fleet
        slot = pick(fleet)
        victim.append(slot.name)
        slot.actor.kill()
        if rerouted is not None:
            await until(task, lambda: slot.name not in fleet.routes()["agent"], "routes without the victim")
            rerouted.append(await asyncio.to_thread(_workers_reach, fleet, fleet.routes_epoch))
        return await task

    summary = asyncio.run(scenario())
    return driver, summary, events, victim[0]


def _workers_reach(fleet: Any, epoch: int) -> bool:
    """Every live workflow worker reports routing table `epoch` (a push the run's last housekeeping
    round sent may still be on its way: calls to a concurrent actor can run out of order)."""
    for _ in range(100):
        live = [w.actor.stats() for w in fleet.workers.values() if not w.dead]
        if live and all(s.routes_epoch == epoch for s in ray.get(live)):
            return True
        time.sleep(0.1)
    return False
