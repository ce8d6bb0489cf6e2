"""Every advantage estimator trains a job end to end (workers, buffer, DeepSpeed rank): the
estimators' formulas are tested on fixed tensors in tests/runtime/algorithms/test_estimators.py;
here each one's signals reach the trainer and take optimizer steps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from driver_harness import make_job, policy, run

from polyrl_runtime.coordinator.placement import shared_trainers

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
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


def critic_job(steps: int) -> Any:
    return make_job(
        mode="sync",
        maxStaleness=0,
        training={"totalSteps": steps},
        policies=[policy(algorithm={"name": "ppo", "groupSize": 1, "critic": {"lr": 1e-3}})],
        checkpoint={"everySteps": 1, "keep": 5},
    )


def test_ppo_with_a_critic_trains_checkpoints_and_resumes_with_it(ray_local: Any, tmp_path: Path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    whole.mkdir(), split.mkdir()
    _, a = run(critic_job(4), whole)
    assert a.state == "done", a.message
    assert [r.step for r in a.records] == [1, 2, 3, 4]
    assert all(r.value_loss > 0 and math.isfinite(r.value_loss) for r in a.records)
    assert all(0.0 <= r.value_clip_frac <= 1.0 for r in a.records)

    _, b1 = run(critic_job(2), split)
    assert b1.state == "done", b1.message
    assert list((split / "ckpt").rglob("critic")), "the trainer checkpoint holds the critic"
    _, b2 = run(critic_job(4), split)  # resumes from the step-2 checkpoint
    assert b2.state == "done" and b2.steps == {"agent": 4}, b2.message
    assert [r.step for r in b2.records if r.step > 2] == [3, 4]
    assert all(r.value_loss > 0 for r in b2.records)
    # The resumed critic continued the saved one: its engine's optimizer-step count went on from
    # step 2's, as the whole run's did (a fresh critic would count from 0 again).
    assert (
        critic_optimizer_steps(split, 3)
        == critic_optimizer_steps(whole, 3)
        > critic_optimizer_steps(split, 2)
    )


def critic_optimizer_steps(tmp: Path, step: int) -> int:
    """The optimizer steps the critic had taken at the checkpoint of `step` (DeepSpeed's count)."""
    (states,) = (tmp / "ckpt" / f"step-{step:06d}").rglob("critic/*/mp_rank_00_model_states.pt")
    return int(torch.load(states, map_location="cpu", weights_only=False)["global_steps"])


def test_ppo_with_a_critic_trains_over_two_ranks(ray_local: Any, tmp_path: Path) -> None:
    """Each rank trains its critic on its share; their collectives (the values' normalisation, the
    value loss's token count, the guarded optimizer steps) stay aligned."""
    job = make_job(
        mode="sync",
        maxStaleness=0,
        training={"totalSteps": 2, "episodesPerStep": 8},
        policies=[
            policy(
                algorithm={"name": "ppo", "groupSize": 1, "critic": {"lr": 1e-3}},
                trainer={"gpus": 0, "ranksPerPod": 2, "zeroStage": 2, "microBatchSize": 4},
            )
        ],
    )
    driver, summary = run(job, tmp_path)
    try:
        assert summary.state == "done", summary.message
        assert len(driver.runs["agent"].ranks) == 2
        assert all(r.samples == 16 and r.value_loss > 0 for r in summary.records)
    finally:
        driver.close()


def lora_critic_job(steps: int) -> Any:
    """Two LoRA policies on one base whose trainers share one rank (trainers/shared_rank.py); the
    speaker is ppo with a critic, which is then a value adapter on that base."""
    lora = {"rank": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj"]}
    hf = {"uri": "builtin://tiny-qwen2", "dtype": "float32"}
    on_pool = {"engine": "torch", "pool": "shared"}
    speaker = policy("speaker", model=hf)
    speaker["algorithm"] = {"name": "ppo", "groupSize": 1, "lr": 1e-2, "lora": lora, "critic": {"lr": 1e-2}}
    listener = policy("listener", model=hf)
    listener["algorithm"] = {"name": "grpo", "groupSize": 4, "lr": 1e-2, "lora": lora}
    for p in (speaker, listener):
        p["rollout"] = dict(on_pool)
        p["trainer"] = {"backend": "deepspeed", "zeroStage": 1, "microBatchSize": 8, "pool": "shared"}
    return make_job(
        mode="sync",
        maxStaleness=0,
        training={"totalSteps": steps, "episodesPerStep": 8, "seed": 3},
        workflow={
            "entrypoint": "polyrl_runtime.workflows.guessing:Guessing",
            "args": {"agents": ["speaker", "listener"], "symbols": 4, "shift": 1, "reply_tokens": 3},
        },
        policies=[speaker, listener],
        pools=[{"name": "shared", "gpus": 0}],
        checkpoint={"everySteps": 1, "keep": 5},
    )


def test_a_lora_policys_critic_trains_on_the_shared_base_and_resumes(ray_local: Any, tmp_path: Path) -> None:
    job = lora_critic_job(2)
    members = ("speaker", "listener")
    assert shared_trainers(job.spec) == dict.fromkeys(members, members)
    _, first = run(job, tmp_path)
    assert first.state == "done", first.message
    speaker = [r for r in first.records if r.policy == "speaker"]
    assert [r.step for r in speaker] == [1, 2]
    assert all(r.value_loss > 0 and math.isfinite(r.value_loss) for r in speaker)
    assert all(r.value_loss == 0 for r in first.records if r.policy == "listener")
    (saved,) = (tmp_path / "ckpt" / "step-000002").rglob("critic/*/adapter-rank0.pt")
    state = torch.load(saved, map_location="cpu", weights_only=True)
    assert state["policy"] == "speaker" and "value_head.weight" in state["adapter"]
    assert any(".speaker_value." in name for name in state["adapter"])

    _, resumed = run(lora_critic_job(3), tmp_path)  # from the step-2 checkpoint
    assert resumed.state == "done" and resumed.steps == {"speaker": 3, "listener": 3}, resumed.message
    assert [r.value_loss > 0 for r in resumed.records if r.policy == "speaker" and r.step == 3] == [True]
