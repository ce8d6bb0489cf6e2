"""algorithm.lossAggregation in a DeepSpeed rank's step (CPU, gloo, world 1): the step's loss is its
micro-batches' numerators over the step's token count (token-mean) or sequence count (the seq-mean
modes), so splitting the rows over micro-batches leaves it unchanged, and token-mean and
seq-mean-token-sum, whose numerators agree, differ exactly by tokens / sequences."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from polyrl_operator.api import Policy
from polyrl_runtime.trainers import deepspeed_trainer
from polyrl_testenv.trainer_rank import OneLease, fixed_batch, in_process_rank

RESPONSE_LENGTHS = [1, 2, 6, 3]
REWARDS = [1.0, 0.0, 0.0, 1.0]


def _step_loss(model_dir: Path, aggregation: str, micro: int, n_micro: int) -> float:
    policy = Policy.model_validate(
        {
            "name": "agent",
            "model": {"uri": f"file://{model_dir}", "dtype": "float32"},
            "algorithm": {"name": "grpo", "lr": 1e-3, "lossAggregation": aggregation},
            "rollout": {"engine": "torch", "gpus": 0},
            "trainer": {"gpus": 0, "zeroStage": 0, "microBatchSize": micro},
        }
    )
    rank = in_process_rank(policy)
    rank.buffer = OneLease(fixed_batch(RESPONSE_LENGTHS, REWARDS, one_episode=True))  # type: ignore[assignment]
    result = rank.train_step(1, len(RESPONSE_LENGTHS), n_micro)
    assert result.tokens == sum(RESPONSE_LENGTHS)
    return result.loss


def test_the_step_loss_follows_its_aggregation(
    gloo: None, tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deepspeed_trainer, "ray", SimpleNamespace(get=lambda ref: ref))
    loss = {
        (mode, n_micro): _step_loss(tiny_qwen2_dir, mode, 4 // n_micro, n_micro)
        for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
        for n_micro in (1, 2)
    }
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert loss[(mode, 2)] == pytest.approx(loss[(mode, 1)], rel=1e-5, abs=1e-7), mode
    tokens, sequences = sum(RESPONSE_LENGTHS), len(RESPONSE_LENGTHS)
    want = loss[("token-mean", 1)] * tokens / sequences
    assert abs(want) > 1e-4
    assert loss[("seq-mean-token-sum", 1)] == pytest.approx(want, rel=1e-5)
    assert loss[("seq-mean-token-mean", 1)] != pytest.approx(loss[("token-mean", 1)], rel=1e-3)
