"""algorithm.critic in a DeepSpeed rank's step (CPU, gloo, world 1): the policy's loss receives the
normalised GAE advantages of the critic's values before the step (with the KL in the token rewards
under klIn reward), the critic trains on the returns in the same step and its loss falls, the
warmup steps train the critic alone, the rank's checkpoint holds the critic, and an offload moves it
with the rank."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.algorithms.advantages import EPS
from polyrl_runtime.algorithms.gae import gae, token_rewards
from polyrl_runtime.algorithms.losses import kl_penalty, policy_loss, sequence_logprobs
from polyrl_runtime.trainers import critic as critic_module
from polyrl_runtime.trainers import deepspeed_trainer
from polyrl_runtime.trainers.batching import micro_batches
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer
from polyrl_runtime.trainers.offload import rank_storages
from polyrl_runtime.trainers.step_inputs import token_batch
from polyrl_testenv.trainer_rank import OneLease, fixed_batch, in_process_rank

RESPONSE_LENGTHS = [1, 2, 6, 3]
REWARDS = [1.0, 0.0, 0.5, 1.0]
KL_COEF = 0.5
GAMMA, LAMBDA = 0.9, 0.8
CPU = torch.device("cpu")


def _policy(kl_in: str | None = None, warmup: int = 0) -> Policy:
    kl = {"klCoef": KL_COEF, "klIn": kl_in} if kl_in else {}
    return Policy.model_validate(
        {
            "name": "agent",
            "model": {"uri": "builtin://tiny", "dtype": "float32"},
            "algorithm": {
                "name": "ppo",
                "groupSize": 1,
                "lr": 1e-3,
                **kl,
                "critic": {"lr": 3e-3, "gamma": GAMMA, "gaeLambda": LAMBDA, "warmupSteps": warmup},
            },
            "rollout": {"engine": "torch", "gpus": 0},
            "trainer": {"gpus": 0, "zeroStage": 1, "microBatchSize": 2},
        }
    )


def _step(rank: DeepSpeedTrainer, step: int) -> Any:
    rank.buffer = OneLease(fixed_batch(RESPONSE_LENGTHS, REWARDS))  # type: ignore[assignment]
    return rank.train_step(step, len(RESPONSE_LENGTHS), 2)


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deepspeed_trainer, "ray", SimpleNamespace(get=lambda ref: ref))


@pytest.mark.parametrize("kl_in", [None, "reward"])
def test_the_loss_receives_gae_advantages_and_the_critic_learns(
    gloo: None, no_ray: None, monkeypatch: pytest.MonkeyPatch, kl_in: str | None
) -> None:
    rank = in_process_rank(_policy(kl_in))
    critic = rank.critic
    assert critic is not None
    with torch.no_grad():  # values that differ per token, and a policy away from its reference
        gen = torch.Generator().manual_seed(0)
        critic.engine.module.head.weight.add_(
            0.3 * torch.randn(critic.engine.module.head.weight.shape, generator=gen)
        )
        for p in rank.engine.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    batch = fixed_batch(RESPONSE_LENGTHS, REWARDS)
    samples = batch.samples()
    advs, masks = [], []
    with torch.no_grad():
        for i, s in enumerate(samples):
            tb = token_batch(samples, [i])[0]
            shaping = None
            if kl_in:
                prox = sequence_logprobs(rank.engine, tb, rank.temperature)
                ref = sequence_logprobs(rank.ref, tb, rank.temperature)
                shaping = -KL_COEF * kl_penalty(ref - prox, "k3")
            rewards = token_rewards(torch.tensor([s.reward]), tb.response_mask, shaping)
            adv, _ = gae(rewards, critic.values(tb), tb.response_mask, GAMMA, LAMBDA)
            advs.append(adv[0])
            masks.append(tb.response_mask[0])
    flat = torch.cat(advs)
    assert float(flat.abs().min()) > 0  # the values entered: no advantage is a plain discounted reward of 0
    want = [(a - flat.mean()) / (flat.std() + EPS) for a in advs]

    seen: dict[int, torch.Tensor] = {}
    rows = iter(r for r in micro_batches(batch, 2, 2) if r)

    def recording(*args: Any, **kwargs: Any) -> Any:
        adv = args[3]
        assert adv.shape == args[0].shape  # per token
        for j, i in enumerate(next(rows)):
            seen[i] = adv[j, : RESPONSE_LENGTHS[i]]
        return policy_loss(*args, **kwargs)

    monkeypatch.setattr(deepspeed_trainer, "policy_loss", recording)
    first = _step(rank, 1)
    assert sorted(seen) == list(range(len(samples)))
    for i, w in enumerate(want):
        assert torch.allclose(seen[i].cpu(), w, atol=1e-4), (i, seen[i], w)

    monkeypatch.setattr(deepspeed_trainer, "policy_loss", policy_loss)
    losses = [first.value_loss] + [_step(rank, step).value_loss for step in range(2, 7)]
    assert all(v > 0 for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses


def test_warmup_steps_train_the_critic_alone(gloo: None, no_ray: None) -> None:
    rank = in_process_rank(_policy(warmup=1))
    critic = rank.critic
    assert critic is not None
    policy_before = [p.detach().clone() for p in rank.engine.module.parameters()]
    head_before = critic.engine.module.head.weight.detach().clone()
    _step(rank, 1)
    assert all(torch.equal(a, b) for a, b in zip(policy_before, rank.engine.module.parameters(), strict=True))
    assert not torch.equal(head_before, critic.engine.module.head.weight)
    _step(rank, 2)
    assert not all(
        torch.equal(a, b) for a, b in zip(policy_before, rank.engine.module.parameters(), strict=True)
    )


def test_the_rank_checkpoint_holds_the_critic(gloo: None, no_ray: None, tmp_path: Path) -> None:
    rank = in_process_rank(_policy())
    assert rank.critic is not None
    for step in (1, 2):
        _step(rank, step)
    rank.save(str(tmp_path), "trainer")
    saved = {k: v.clone() for k, v in rank.critic.engine.module.state_dict().items()}

    again = in_process_rank(_policy())
    assert again.critic is not None
    again.load(str(tmp_path), "trainer")
    loaded = again.critic.engine.module.state_dict()
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert not torch.equal(saved["head.weight"], torch.zeros_like(saved["head.weight"]))
    # Both continue alike: the optimizer's state came back with the weights.
    assert _step(again, 3).value_loss == pytest.approx(_step(rank, 3).value_loss, rel=1e-5)


def test_the_critic_is_offloaded_and_restored_with_the_rank(gloo: None, no_ray: None) -> None:
    rank = in_process_rank(_policy())
    critic = rank.critic
    assert critic is not None
    _step(rank, 1)  # the critic's optimizer holds state
    before = {k: v.clone() for k, v in critic.engine.module.state_dict().items()}
    held = rank_storages(rank.engine, rank.ref, CPU, critic.engine)
    assert len(held) > len(rank_storages(rank.engine, rank.ref, CPU))
    held_bytes = sum(s.nbytes() for s in held)
    report = rank.offload()
    assert report.moved_bytes == held_bytes
    assert not rank_storages(rank.engine, rank.ref, CPU, critic.engine)
    assert all(p.untyped_storage().nbytes() == 0 for p in critic.engine.module.parameters())
    rank.restore()
    after = critic.engine.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert _step(rank, 2).value_loss > 0


def test_a_non_finite_value_loss_skips_the_critics_steps_and_is_counted(
    gloo: None, no_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    rank = in_process_rank(_policy())
    critic = rank.critic
    assert critic is not None
    head_before = critic.engine.module.head.weight.detach().clone()
    real = critic_module.value_loss

    def nan_loss(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, float]:
        loss, frac = real(*args, **kwargs)
        return loss * math.nan, frac

    monkeypatch.setattr(critic_module, "value_loss", nan_loss)
    result = _step(rank, 1)
    assert critic.guard.skipped == critic.guard.steps > 0
    assert result.skipped_nonfinite == critic.guard.skipped  # the policy's own steps were finite
    assert torch.equal(head_before, critic.engine.module.head.weight)
