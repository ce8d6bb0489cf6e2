"""algorithm.lossAggregation in a DeepSpeed rank's step (CPU, gloo, world 1): the step's loss is its
micro-batches' numerators over the step's token count (token-mean) or sequence count (the seq-mean
modes), so splitting the rows over micro-batches leaves it unchanged, and token-mean and
seq-mean-token-sum, whose numerators agree, differ exactly by tokens / sequences."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from polyrl_operator.api import Policy
from polyrl_runtime.experience import SampleBatch
from polyrl_runtime.experience.state import Lease
from polyrl_runtime.experience.types import Sample
from polyrl_runtime.trainers import deepspeed_trainer
from polyrl_testenv.trainer_rank import in_process_rank

RESPONSE_LENGTHS = [1, 2, 6, 3]
REWARDS = [1.0, 0.0, 0.0, 1.0]


def _batch() -> SampleBatch:
    samples = [
        Sample(
            sample_id=f"s{i}",
            episode_id="e0",
            policy="agent",
            agent="agent",
            turn_index=i,
            reward=REWARDS[i],
            prompt_ids=np.array([1, 5, 9], dtype=np.int32),
            response_ids=(np.arange(n, dtype=np.int32) % 7) + 2,
            logprobs=np.full(n, -2.0, dtype=np.float32),
            versions=np.zeros(n, dtype=np.int32),
        )
        for i, n in enumerate(RESPONSE_LENGTHS)
    ]
    return SampleBatch.from_samples("agent", samples)


class _OneLease:
    def __init__(self, batch: SampleBatch) -> None:
        self.lease: Lease | None = Lease(1, "agent", "agent-trainer-0", batch)

    def pull(self, policy: str, consumer: str, max_samples: int, timeout: float) -> Lease | None:
        lease, self.lease = self.lease, None
        return lease


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
    rank.buffer = _OneLease(_batch())  # type: ignore[assignment]
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
