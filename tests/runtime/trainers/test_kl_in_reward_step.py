"""algorithm.klIn reward in a DeepSpeed rank's step (CPU, gloo, world 1): the loss receives per-token
advantages, the whitened returns of the reward less the KL to go (reference against the weights the
step began with), the same however the rows are split over micro-batches, and no KL term."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.algorithms.advantages import EPS
from polyrl_runtime.algorithms.losses import importance_weights, kl_penalty, policy_loss, sequence_logprobs
from polyrl_runtime.trainers import deepspeed_trainer
from polyrl_runtime.trainers.batching import micro_batches
from polyrl_runtime.trainers.step_inputs import token_batch
from polyrl_testenv.trainer_rank import OneLease, fixed_batch, in_process_rank

RESPONSE_LENGTHS = [1, 2, 6, 3]
REWARDS = [1.0, 0.0, 0.5, 1.0]
KL_COEF = 0.5


@pytest.mark.parametrize(("name", "n_micro"), [("reinforce_pp", 1), ("reinforce_pp", 2), ("ppo", 2)])
def test_the_step_trains_on_whitened_returns_with_the_kl_to_go(
    gloo: None, tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch, name: str, n_micro: int
) -> None:
    policy = Policy.model_validate(
        {
            "name": "agent",
            "model": {"uri": f"file://{tiny_qwen2_dir}", "dtype": "float32"},
            "algorithm": {"name": name, "groupSize": 1, "lr": 1e-3, "klCoef": KL_COEF, "klIn": "reward"},
            "rollout": {"engine": "torch", "gpus": 0},
            "trainer": {"gpus": 0, "zeroStage": 0, "microBatchSize": len(RESPONSE_LENGTHS) // n_micro},
        }
    )
    rank = in_process_rank(policy)
    assert rank.ref is not None
    with torch.no_grad():  # the policy moved away from its reference: a KL to shape the reward with
        gen = torch.Generator().manual_seed(0)
        for p in rank.engine.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    batch = fixed_batch(RESPONSE_LENGTHS, REWARDS)
    samples = batch.samples()
    kl, returns, weights = [], [], []
    with torch.no_grad():
        for i, s in enumerate(samples):
            tb, behav = token_batch(samples, [i])
            prox = sequence_logprobs(rank.engine, tb, rank.temperature)[0]
            k = kl_penalty(sequence_logprobs(rank.ref, tb, rank.temperature)[0] - prox, "k3")
            kl.append(k)
            returns.append(s.reward - KL_COEF * k.flip(0).cumsum(0).flip(0))
            weights.append(importance_weights(prox, behav[0], tb.response_mask[0], "token-truncate", 2.0)[0])
    values = torch.cat(returns)
    want = [(g - values.mean()) / (values.std() + EPS) for g in returns]
    assert float(torch.cat(kl).mean()) > 1e-3

    seen: dict[int, torch.Tensor] = {}
    rows = iter(r for r in micro_batches(batch, len(RESPONSE_LENGTHS) // n_micro, n_micro) if r)

    def recording(*args: Any, **kwargs: Any) -> Any:
        adv = args[3]
        assert adv.shape == args[0].shape and kwargs["cfg"].kl_in == "reward"
        assert kwargs["ref_logp"] is not None  # scored once, before the step, and handed on
        for j, i in enumerate(next(rows)):
            seen[i] = adv[j, : RESPONSE_LENGTHS[i]]
        return policy_loss(*args, **kwargs)

    monkeypatch.setattr(deepspeed_trainer, "policy_loss", recording)
    monkeypatch.setattr(deepspeed_trainer, "ray", SimpleNamespace(get=lambda ref: ref))
    rank.buffer = OneLease(batch)  # type: ignore[assignment]
    result = rank.train_step(1, len(RESPONSE_LENGTHS), n_micro)

    assert sorted(seen) == list(range(len(RESPONSE_LENGTHS)))
    for i, w in enumerate(want):
        assert torch.allclose(seen[i].cpu(), w, atol=1e-4), (i, seen[i], w)
    if name == "reinforce_pp":  # every micro-batch at the step's initial weights
        assert result.kl == pytest.approx(float(torch.cat(kl).mean()), rel=1e-4)
        # token-mean of -w A at ratio 1: no KL term in the loss
        want_loss = -sum(float((wt * a).sum()) for wt, a in zip(weights, want, strict=True)) / len(values)
        assert result.loss == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
