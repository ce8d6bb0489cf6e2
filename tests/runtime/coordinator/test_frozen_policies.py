"""A frozen policy (`frozen: true`): its engines serve it and it is never trained. No trainer
ranks, no weight sync, no checkpoint state of its own; its turns reach the buffer and are dropped
there, counted as policy_frozen; the trained policy's steps are the job's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from polyrl_runtime.coordinator.job_state import PolicyRun

from .driver_harness import cpu_pools_take_turns, make_job, new_driver, policy, run, until

SIGNAL = {
    "entrypoint": "polyrl_runtime.workflows.signal:SignalGame",
    "args": {"vocab": 4, "symbols": 3, "policies": {"speaker": "speaker", "listener": "listener"}},
}


POOL_SETS = {"replicas", "gpus", "gpuType", "image", "resources", "env", "podTemplate"}


def _job(*, pooled: bool = False) -> Any:
    speaker, listener = policy("speaker"), policy("listener", frozen=True)
    del listener["trainer"]  # a frozen policy has none
    extra: dict[str, Any] = {}
    if pooled:  # the speaker's engine and trainer and the listener's engine take turns on one pool
        extra["pools"] = [{"name": "shared", "gpus": 0, "replicas": {"min": 1, "max": 1}}]
        for p, roles in ((speaker, ("rollout", "trainer")), (listener, ("rollout",))):
            for role in roles:
                p[role] = {k: v for k, v in p[role].items() if k not in POOL_SETS} | {"pool": "shared"}
    return make_job(training={"totalSteps": 3}, workflow=SIGNAL, policies=[speaker, listener], **extra)


@pytest.mark.slow
def test_a_frozen_policy_is_served_and_never_trained(ray_local: Any, tmp_path: Path) -> None:
    job = _job()
    driver = new_driver(job, tmp_path)

    async def go() -> Any:
        task = asyncio.ensure_future(driver.run())
        await until(task, lambda: driver.state == "running", "the job to start")
        listener = driver.snapshot().policies[1]
        assert listener.name == "listener" and listener.trainer_state == "frozen"  # from the start
        return await task

    summary = asyncio.run(go())
    assert summary.state == "done", summary.message
    assert summary.message == "all policies finished"  # a frozen policy is no failure
    runs: dict[str, PolicyRun] = driver.runs
    assert runs["listener"].ranks == [] and runs["listener"].sync is None
    assert runs["speaker"].step == 3 and runs["listener"].step == 0
    assert {r.policy for r in summary.records} == {"speaker"}  # only the trained policy steps
    # The listener played every episode; none of its samples was trained on.
    assert summary.dropped["listener"]["policy_frozen"] > 0
    assert summary.buffers["listener"]["consumed"] == 0
    assert summary.dropped["speaker"]["policy_frozen"] == 0
    # Its engine served the weights it loaded, version 0, throughout.
    assert all(e.version == 0 for e in driver.snapshot().policies[1].engines)
    # The checkpoints hold the speaker's trainer state only, named by the speaker's step.
    final = Path(summary.checkpoint or "")
    assert final.name == "step-000003"
    assert sorted(p.name for p in (final / "trainers").iterdir()) == ["speaker"]


@pytest.mark.slow
def test_a_frozen_policy_shares_a_pool_with_a_trained_one(
    ray_local: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a pool its engine sleeps through the trained policy's turns and serves between them, as
    the trained policy's own engine does; it receives no weights."""
    cpu_pools_take_turns(monkeypatch)
    driver, summary = run(_job(pooled=True), tmp_path)
    assert summary.state == "done", summary.message
    assert [r.step for r in summary.records] == [1, 2, 3]
    assert all(r.pool == "shared" for r in summary.records)
    assert summary.dropped["listener"]["policy_frozen"] > 0
    assert all(e.version == 0 for e in driver.snapshot().policies[1].engines)


@pytest.mark.slow
def test_a_frozen_judge_scores_a_trained_solver(ray_local: Any, tmp_path: Path) -> None:
    """LLM-as-judge (workflows/judge.py): the solver's reward is the frozen judge's verdict; the
    judge's turns are dropped as policy_frozen, and a judge that gives no verdict fails episodes
    as judge_error."""
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(f'{{"prompt": "{i}+0=", "answer": {i}}}\n' for i in range(8)))
    solver, judge = policy("solver"), policy("judge", frozen=True)
    del judge["trainer"]

    def job(**judge_args: Any) -> Any:
        args = {
            "agent": "solver",
            "max_new_tokens": 2,
            "judge": {"agent": "judge", "chat": False, "verdicts": {"y": 1.0, "n": 0.0}, **judge_args},
            "policies": {"solver": "solver", "judge": "judge"},
        }
        return make_job(
            mode="sync",
            maxStaleness=0,
            training={"totalSteps": 2, "episodesPerStep": 8},
            workflow={"entrypoint": "polyrl_runtime.workflows.prompts:PromptCompletion", "args": args},
            data={"train": f"file://{rows}"},
            policies=[solver, judge],
        )

    _, summary = run(job(), tmp_path / "constrained")
    assert summary.state == "done", summary.message
    assert [r.step for r in summary.records] == [1, 2] and {r.policy for r in summary.records} == {"solver"}
    assert summary.failed == {} or sum(summary.failed.values()) == 0
    assert summary.dropped["judge"]["policy_frozen"] == summary.buffers["judge"]["produced"] > 0
    # A random judge says y to some replies and n to others: rewards are verdicts, 0 or 1.
    assert all(r.reward_mean is not None and 0.0 <= r.reward_mean <= 1.0 for r in summary.records)

    # Unconstrained, a random tiny model's two tokens are rarely a verdict: judge_error, counted.
    _, free = run(job(constrained=False, max_new_tokens=2), tmp_path / "free", max_consecutive_failures=6)
    assert free.failed.get("judge_error", 0) > 0, free.failed
    assert set(free.failed) <= {"judge_error"}


def _distilling(teacher_model: str, steps: int) -> Any:
    """The selfplay game with every reward equal (no signal from the reward: grpo's advantages are
    0) and a frozen teacher the agent distils from."""
    agent = policy(
        "agent",
        algorithm={"name": "grpo", "groupSize": 4, "lr": 1e-2, "distillation": {"teacher": "teacher"}},
    )
    teacher = policy("teacher", frozen=True, model={"uri": teacher_model})
    del teacher["trainer"]
    return make_job(
        mode="sync",
        maxStaleness=0,
        training={"totalSteps": steps},
        workflow={
            "entrypoint": "faulty_workflows:AlwaysTied",
            "args": {"vocab": 4, "symbols": 3, "policies": {"speaker": "agent", "listener": "agent"}},
        },
        policies=[agent, teacher],
    )


@pytest.mark.slow
def test_a_student_distils_from_a_frozen_teacher(ray_local: Any, tmp_path: Path) -> None:
    """On-policy distillation: with no reward signal, the per-token reverse KL to the teacher on the
    student's own samples is what the student learns, and it falls."""
    _, summary = run(_distilling("builtin://tiny", steps=8), tmp_path)
    assert summary.state == "done", summary.message
    kls = [r.distill_kl for r in summary.records]
    assert len(kls) == 8 and all(k > 0 for k in kls[:1]), kls
    assert sum(kls[-2:]) / 2 < 0.7 * sum(kls[:2]) / 2, kls
    assert summary.dropped["teacher"]["policy_frozen"] == 0  # the workflow never calls the teacher


@pytest.mark.slow
def test_a_teacher_whose_tokenizer_differs_fails_the_job_at_start(ray_local: Any, tmp_path: Path) -> None:
    _, summary = run(_distilling("builtin://tiny-qwen2", steps=1), tmp_path)
    assert summary.state == "failed", summary.message
    assert "algorithm.distillation.teacher 'teacher' cannot score its tokens" in summary.message, (
        summary.message
    )
    assert "vocabulary sizes differ" in summary.message
