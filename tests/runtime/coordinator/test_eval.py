"""Evaluation: pass@k and mean reward from eval episodes (table), the /progress document carrying a
policy's latest pass, and a tiny job under `polyrl run` (tiny-qwen2, a generic data-driven workflow)
that evaluates before training, every 2 steps and at the end, with the results in its metrics and plot."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from polyrl_operator.api.progress import EvalProgress
from polyrl_runtime.coordinator.evaluation import summarize
from polyrl_runtime.coordinator.job_state import PolicyRun
from polyrl_runtime.coordinator.report import JobSnapshot, PolicySnapshot, progress_report
from polyrl_testenv.localrun import metrics_rows, run_to_end, write_job

Episodes = Sequence[Sequence[Mapping[str, float] | str]]


@pytest.mark.parametrize(
    ("per_row", "threshold", "expected"),
    [
        # expected: mean reward, pass@k, rows where the policy acted, failed eval episodes
        ([[{"a": 1.0}, {"a": 0.0}], [{"a": 0.0}, {"a": 0.0}]], 1.0, (0.25, 0.5, 2, 0)),
        ([[{"a": 0.5}], [{"a": 0.9}]], 0.5, (0.7, 1.0, 2, 0)),
        ([[{"a": 1.0}, "episode e-1 (reward_error): boom"], ["x", "y"]], 1.0, (1.0, 1.0, 1, 3)),
        ([[{"b": 1.0}]], 1.0, (None, None, 0, 0)),  # the policy never acted
        ([], 1.0, (None, None, 0, 0)),
    ],
)
def test_summarize_pass_at_k(
    per_row: Episodes, threshold: float, expected: tuple[float | None, float | None, int, int]
) -> None:
    reward, pass_at_k, rows, failed = expected
    r = summarize("a", 4, 2, per_row, threshold)
    assert (r.policy, r.step, r.k, r.rows, r.failed) == ("a", 4, 2, rows, failed)
    assert r.reward_mean == (pytest.approx(reward) if reward is not None else None)
    assert r.pass_at_k == pass_at_k


def test_progress_reports_the_latest_eval_pass_per_policy() -> None:
    ev = EvalProgress(step=4, reward_mean=0.25, pass_at_k=0.5, k=2, rows=8)
    pol = PolicySnapshot("a", 4, 0.1, (0.0, 0), None, [], 0, evaluation=ev)
    snap = JobSnapshot(
        state="running",
        message="",
        retryable=True,
        attempt=None,
        policies=[pol, PolicySnapshot("b", 4, None, (0.0, 0), None, [], 0)],
        workers=[],
        last_ckpt_step=None,
        last_ckpt_location=None,
        last_request_id=None,
        ckpt_in_progress=False,
        episodes=0,
        failed={},
        elapsed_s=1.0,
    )
    wire = progress_report(snap).to_wire()
    assert wire["policies"][0]["evaluation"] == {
        "step": 4,
        "rewardMean": 0.25,
        "passAtK": 0.5,
        "k": 2,
        "rows": 8,
    }
    assert "evaluation" not in wire["policies"][1]


def _rows(path: Path, n: int, offset: int, *, chat: bool = False) -> str:
    """Rows with a plain `prompt`, or (`chat`) with `messages` for the policy's chat template."""

    def row(i: int) -> dict[str, object]:
        ask = {"messages": [{"role": "user", "content": f"{i}+1="}]} if chat else {"prompt": f"{i}+1="}
        return {"id": i, **ask, "answer": i + 1}

    path.write_text("".join(json.dumps(row(i)) + "\n" for i in range(offset, offset + n)))
    return f"file://{path}"


@pytest.mark.slow
def test_polyrl_run_evaluates_every_n_steps_and_at_the_end(tmp_path: Path) -> None:
    job = {
        "apiVersion": "polyrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "evaluated"},
        "spec": {
            "mode": "sync",
            "training": {"totalSteps": 3, "episodesPerStep": 8, "seed": 1},
            "workflow": {
                "entrypoint": "polyrl_runtime.workflows.prompts:PromptCompletion",
                "args": {"reward": "numeric", "max_new_tokens": 3},
            },
            "data": {
                "train": _rows(tmp_path / "train.jsonl", 12, 0),
                "eval": _rows(tmp_path / "eval.jsonl", 5, 100, chat=True),
            },
            "evaluation": {"everySteps": 2, "k": 3, "greedy": False, "passThreshold": 1.0},
            "policies": [
                {
                    "name": "agent",
                    "model": {"uri": "builtin://tiny-qwen2", "dtype": "float32"},
                    "algorithm": {"name": "grpo", "groupSize": 4, "lr": 1.0e-3},
                    "rollout": {"engine": "torch", "gpus": 0},
                    "trainer": {"backend": "deepspeed", "zeroStage": 1, "gpus": 0},
                }
            ],
        },
    }
    out = tmp_path / "out"
    summary = run_to_end(write_job(job, tmp_path / "job.yaml"), out, "--plain")
    rows = metrics_rows(out)
    assert [x["step"] for x in rows] == [0, 1, 2, 3]
    # step 0: the pass of the initial weights (evaluation.beforeTraining, on by default); no step ran
    before = rows[0]
    assert (before["reward_mean"], before["samples"], before["version"]) == (None, 0, 0)
    assert "eval_before_training" in summary["startup"]
    assert summary["first_reward"]["agent"] == rows[1]["reward_mean"]  # the series starts at step 1
    assert rows[1].get("eval_reward_mean") is None and rows[1].get("eval_pass_at_k") is None
    for x in [rows[0], *rows[2:]]:  # step 0, step 2 (everySteps) and step 3 (the last)
        assert 0.0 <= x["eval_reward_mean"] <= 1.0 and 0.0 <= x["eval_pass_at_k"] <= 1.0
        # pass@k counts a row once any of its k episodes is right: never below the mean reward
        assert x["eval_pass_at_k"] >= x["eval_reward_mean"] - 1e-9
    assert (out / "reward_agent.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "evaluation",
    [EvalProgress(step=4, reward_mean=0.25, pass_at_k=0.5, k=2, rows=8), EvalProgress(step=2), None],
)
def test_a_checkpoint_keeps_the_latest_eval_pass_for_the_resumed_job(evaluation: EvalProgress | None) -> None:
    """A resumed job reports the pass of its checkpoint (in /progress and the RLJob status) until it
    evaluates again, rather than nothing for up to `everySteps` steps."""
    saved = PolicyRun("a", [], step=4, samples_per_episode=2, last_eval=evaluation)
    state = json.loads(json.dumps(saved.checkpoint_state()))  # as state.json stores it
    resumed = PolicyRun("a", [])
    resumed.restored(state)
    assert (resumed.samples_per_episode, resumed.last_eval) == (2, evaluation)
    assert state["step"] == state["version"] == 4


def test_a_checkpoint_written_before_evaluation_was_saved_resumes_without_one() -> None:
    resumed = PolicyRun("a", [], last_eval=EvalProgress(step=9))
    resumed.restored({"step": 3, "version": 3, "samples_per_episode": 1})
    assert (resumed.samples_per_episode, resumed.last_eval) == (1, None)
