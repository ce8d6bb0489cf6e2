"""The critic's value model (trainers/critic.py) on its own: values 0 before any update, a constant
return learnt, value clipping, and a checkpoint round trip (CPU, gloo, world 1)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.experience import SampleBatch
from polyrl_runtime.models.tiny import TinyCausalLM
from polyrl_runtime.trainers.batching import share_micro_batches, step_layout
from polyrl_runtime.trainers.build import deepspeed_config
from polyrl_runtime.trainers.critic import CRITIC_DIR, Critic, ValueModel
from polyrl_runtime.trainers.step_inputs import StepInputs, ValueTargets, token_batch
from polyrl_testenv.trainer_rank import fixed_batch

LENGTHS = [3, 1, 5, 2]
CPU = torch.device("cpu")


def _policy(uri: str = "builtin://tiny", stage: int = 0, **critic: Any) -> Policy:
    return Policy.model_validate(
        {
            "name": "agent",
            "model": {"uri": uri, "dtype": "float32"},
            "algorithm": {"name": "ppo", "groupSize": 1, "critic": {"lr": 1e-2, **critic}},
            "rollout": {"engine": "torch", "gpus": 0},
            "trainer": {"gpus": 0, "zeroStage": stage, "microBatchSize": 2},
        }
    )


def _critic(policy: Policy) -> Critic:
    return Critic.build(
        policy, deepspeed_config(policy, torch.float32), seed=0, cuda=False, device=CPU, world=1
    )


def _inputs(critic: Critic, batch: SampleBatch, target: float) -> StepInputs:
    """A step whose every trained token's return is `target`, its old values the critic's now."""
    samples = batch.samples()
    layout = step_layout(share_micro_batches(batch, 2, None, 1), 2, 1)  # one optimizer step
    old, returns = [], []
    with torch.no_grad():
        for rows in layout.micro_rows:
            tb = token_batch(samples, rows)[0]
            old.append(critic.values(tb).cpu())
            returns.append(tb.response_mask * target)
    return StepInputs(
        samples,
        torch.ones(len(samples)),
        layout,
        layout.mini_batches(),
        denominators=[1.0] * layout.minis,
        trains=[True] * layout.minis,
        advantages=[],
        prox=[None] * len(layout.micro_rows),
        refs=[None] * len(layout.micro_rows),
        value_targets=ValueTargets(list(old), list(returns)),
    )


def _values(critic: Critic, batch: SampleBatch) -> torch.Tensor:
    samples = batch.samples()
    tb = token_batch(samples, list(range(len(samples))))[0]
    with torch.no_grad():
        return critic.values(tb)[tb.response_mask > 0]


def _sum_allreduce(values: list[float]) -> list[float]:
    return values


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_the_first_values_are_zero_and_a_constant_return_is_learnt(gloo: None, stage: int) -> None:
    critic = _critic(_policy(stage=stage, valueClip=None))
    module = critic.engine.module
    assert isinstance(module, ValueModel) and isinstance(module.backbone, TinyCausalLM)
    assert not module.backbone.head.weight.requires_grad  # its logits head (untied) takes no part
    batch = fixed_batch(LENGTHS, [1.0] * len(LENGTHS), prompt=(1, 4, 7), token_period=5, logprob=-1.0)
    assert torch.equal(_values(critic, batch), torch.zeros(sum(LENGTHS)))
    losses = []
    for _ in range(40):
        report = critic.train(_inputs(critic, batch, 1.0), 1, _sum_allreduce)
        losses.append(report.loss)
        assert report.clip_frac == 0.0  # unclipped
    assert losses[0] == pytest.approx(0.5, rel=1e-5)  # 0.5 * (0 - 1)^2 per token
    assert losses[-1] < 0.01 * losses[0]
    assert torch.allclose(_values(critic, batch), torch.ones(sum(LENGTHS)), atol=0.1)


def test_a_token_whose_clipped_term_is_larger_carries_no_gradient(gloo: None) -> None:
    """V_old = V - 1 and R = V + 2 (at clip 0.2): the clipped value V_old + 0.2 is 2.8 from R, the
    value itself 2: the clipped term is the loss, and it does not depend on V."""
    critic, batch = (
        _critic(_policy(valueClip=0.2)),
        fixed_batch(LENGTHS, [1.0] * len(LENGTHS), prompt=(1, 4, 7), token_period=5, logprob=-1.0),
    )  # no momentum yet: no gradient, no update
    before = _values(critic, batch)
    inputs = _inputs(critic, batch, 0.0)
    assert inputs.value_targets is not None
    old = inputs.value_targets.old_values
    masks = [token_batch(inputs.samples, rows)[0].response_mask for rows in inputs.layout.micro_rows]
    shifted = ValueTargets(
        [(v - 1.0) * m for v, m in zip(old, masks, strict=True)],  # type: ignore[operator]
        [(v + 2.0) * m for v, m in zip(old, masks, strict=True)],  # type: ignore[operator]
    )
    report = critic.train(replace(inputs, value_targets=shifted), 1, _sum_allreduce)
    assert report.clip_frac == 1.0
    assert report.loss == pytest.approx(0.5 * 2.8**2, rel=1e-4)
    assert torch.allclose(_values(critic, batch), before, atol=1e-6)


def test_a_saved_critic_loads_exactly(gloo: None, tmp_path: Path) -> None:
    policy = _policy(stage=1)
    critic, batch = (
        _critic(policy),
        fixed_batch(LENGTHS, [1.0] * len(LENGTHS), prompt=(1, 4, 7), token_period=5, logprob=-1.0),
    )
    for _ in range(3):
        critic.train(_inputs(critic, batch, 2.0), 1, _sum_allreduce)
    critic.save(tmp_path, "step")
    assert (tmp_path / CRITIC_DIR / "step").is_dir()
    saved = _values(critic, batch)
    after_save = critic.train(_inputs(critic, batch, 2.0), 1, _sum_allreduce)

    fresh = _critic(policy)
    assert not torch.equal(_values(fresh, batch), saved)
    fresh.load(tmp_path, "step")
    assert torch.equal(_values(fresh, batch), saved)
    # The optimizer state came back too: the next step is the one the saved critic took.
    assert fresh.train(_inputs(fresh, batch, 2.0), 1, _sum_allreduce).loss == pytest.approx(
        after_save.loss, rel=1e-6
    )
    assert torch.equal(_values(fresh, batch), _values(critic, batch))


@pytest.mark.parametrize("stage", [0, 3])
def test_the_critic_has_a_model_of_its_own(gloo: None, tiny_qwen2_dir: Path, stage: int) -> None:
    """`critic.model` names another backbone than the policy's (a Hugging Face one, partitioned as
    it loads under ZeRO-3); its values start at 0 all the same, and it learns."""
    policy = _policy(stage=stage, model={"uri": f"file://{tiny_qwen2_dir}", "dtype": "float32"})
    critic = _critic(policy)
    module = critic.engine.module
    assert not isinstance(module.backbone, TinyCausalLM)
    assert torch.equal(
        _values(
            critic, fixed_batch(LENGTHS, [1.0] * len(LENGTHS), prompt=(1, 4, 7), token_period=5, logprob=-1.0)
        ),
        torch.zeros(sum(LENGTHS)),
    )
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    assert {"head.weight", "head.bias"} <= trained
    batch = fixed_batch(LENGTHS, [1.0] * len(LENGTHS), prompt=(1, 4, 7), token_period=5, logprob=-1.0)
    losses = [critic.train(_inputs(critic, batch, 1.0), 1, _sum_allreduce).loss for _ in range(5)]
    assert losses[-1] < losses[0]


def test_a_checkpoint_without_a_critic_leaves_it_fresh(gloo: None, tmp_path: Path) -> None:
    """A policy checkpointed before it had a critic: the value model starts as built (values 0)."""
    critic, batch = (
        _critic(_policy()),
        fixed_batch(LENGTHS, [1.0] * len(LENGTHS), prompt=(1, 4, 7), token_period=5, logprob=-1.0),
    )
    critic.load(tmp_path, "step")
    assert torch.equal(_values(critic, batch), torch.zeros(sum(LENGTHS)))
