"""A turn sampled at a per-call temperature, other than its policy's, trains on-policy: a DeepSpeed
rank (CPU, gloo, world 1) scores it at the temperature it carries, so with the engine's weights its
importance weights are 1, its proximal (PPO) and reference (KL) logprobs agree with its own; scored
at the policy's temperature instead (what the rank did before) they do not."""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.algorithms.losses import sequence_logprobs
from polyrl_runtime.engines.api import Generation, SamplingParams
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.experience import Episode, SampleBatch, Turn
from polyrl_runtime.experience.state import Lease
from polyrl_runtime.trainers import deepspeed_trainer
from polyrl_runtime.trainers.step_inputs import token_batch
from polyrl_testenv.models import lively_qwen2
from polyrl_testenv.trainer_rank import in_process_rank

POLICY_TEMPERATURE = 1.0
CALL_TEMPERATURE = 0.5
PROMPTS = [[1, 5, 9, 14], [2, 7], [3, 8, 11, 4, 6], [10, 12, 13]]


@pytest.fixture(scope="module")
def lively_dir(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Weights far from uniform: the temperature changes every logprob noticeably."""
    return lively_qwen2(tiny_qwen2_dir, tmp_path_factory.mktemp("temperature") / "lively", seed=5)


def _policy(model_dir: Path, algorithm: dict[str, Any]) -> Policy:
    return Policy.model_validate(
        {
            "name": "agent",
            "model": {"uri": f"file://{model_dir}", "dtype": "float32"},
            "algorithm": {"lr": 1e-2, **algorithm},
            "rollout": {"engine": "torch", "gpus": 0, "sampling": {"temperature": POLICY_TEMPERATURE}},
            "trainer": {"gpus": 0, "zeroStage": 0, "microBatchSize": 4},
        }
    )


def _generations(model_dir: Path) -> list[Generation]:
    """The rollout engine's replies at the call's temperature, with the trainer's initial weights."""
    engine = TorchEngine("e0", "agent", f"file://{model_dir}", seed=3, dtype="float32")
    params = SamplingParams(temperature=CALL_TEMPERATURE, max_new_tokens=8)

    async def go() -> list[Generation]:
        return list(await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS)))

    return asyncio.run(go())


def _batch(gens: list[Generation], temperature: float) -> SampleBatch:
    """The samples as a lease delivers them (pickled), each turn recording `temperature`."""
    episodes = [
        Episode(
            f"e{i}",
            (
                Turn(
                    "agent",
                    "agent",
                    np.asarray(p, np.int32),
                    g.token_ids,
                    g.logprobs,
                    g.versions,
                    temperature=temperature,
                ),
            ),
            {"agent": float(i % 2)},
        )
        for i, (p, g) in enumerate(zip(PROMPTS, gens, strict=True))
    ]
    batch = SampleBatch.from_samples("agent", [s for e in episodes for s in e.samples()])
    back = pickle.loads(pickle.dumps(batch))
    assert isinstance(back, SampleBatch)
    return back


class _OneLease:
    """A buffer that hands the rank one lease (its `pull` result stands in for the object ref)."""

    def __init__(self, batch: SampleBatch) -> None:
        self.lease: Lease | None = Lease(1, "agent", "agent-trainer-0", batch)

    def pull(self, policy: str, consumer: str, max_samples: int, timeout: float) -> Lease | None:
        lease, self.lease = self.lease, None
        assert lease is not None and max_samples == len(lease.batch)
        return lease


@pytest.mark.parametrize(
    "algorithm",
    [{"name": "grpo"}, {"name": "ppo", "klCoef": 0.1}],
    ids=["grpo", "ppo-proximal-and-reference"],
)
def test_a_per_call_temperature_trains_on_policy(
    gloo: None, lively_dir: Path, monkeypatch: pytest.MonkeyPatch, algorithm: dict[str, Any]
) -> None:
    gens = _generations(lively_dir)
    rank = in_process_rank(_policy(lively_dir, algorithm))
    assert rank.temperature == POLICY_TEMPERATURE != CALL_TEMPERATURE  # the rank's own: the policy's
    rows = list(range(len(PROMPTS)))
    recorded = _batch(gens, CALL_TEMPERATURE)
    assert recorded.temperatures.tolist() == [CALL_TEMPERATURE] * len(PROMPTS)

    # Before any step: per token, the rank's logprobs are the engine's behaviour logprobs.
    with torch.no_grad():
        for temperature, on_policy in ((CALL_TEMPERATURE, True), (POLICY_TEMPERATURE, False)):
            samples = _batch(gens, temperature).samples()
            tb, behav = token_batch(samples, rows)
            logp = sequence_logprobs(rank.engine, tb, rank.temperature)
            gap = float(((logp - behav).abs() * tb.response_mask).max())
            assert (gap < 1e-4) is on_policy, (temperature, gap)
            _, stats = rank._forward_loss(tb, behav, torch.zeros(len(rows)), None)
            assert (abs(stats.is_weight_mean - 1.0) < 1e-3) is on_policy, (temperature, stats)

    # The step itself, from the lease: importance weights 1; under PPO the proximal logprobs (taken
    # before the first update) and the reference's (the initial weights: KL 0) at the same temperature.
    monkeypatch.setattr(deepspeed_trainer, "ray", SimpleNamespace(get=lambda ref: ref))
    rank.buffer = _OneLease(recorded)  # type: ignore[assignment]
    result = rank.train_step(1, len(PROMPTS), 1)
    assert result.samples == len(PROMPTS) and result.tokens == sum(len(g.token_ids) for g in gens)
    assert result.is_weight_mean == pytest.approx(1.0, abs=1e-3) and result.is_truncated_frac == 0.0
    if algorithm["name"] == "ppo":
        assert result.kl == pytest.approx(0.0, abs=1e-6) and result.clip_frac == 0.0


def test_rows_at_different_temperatures_train_in_one_micro_batch(gloo: None, lively_dir: Path) -> None:
    """Two temperatures in one micro-batch (a per-call one beside the policy's): each row at its own."""
    gens = _generations(lively_dir)
    rank = in_process_rank(_policy(lively_dir, {"name": "grpo"}))
    call = _batch(gens, CALL_TEMPERATURE).samples()
    # The same rows relabelled as sampled at the policy's temperature, with the behaviour logprobs
    # that temperature gives (the rank's own scoring of them, checked against the engine above).
    with torch.no_grad():
        tb, _ = token_batch([replace(s, temperature=POLICY_TEMPERATURE) for s in call], [0, 1])
        at_policy = sequence_logprobs(rank.engine, tb, rank.temperature)
    policy_rows = [
        replace(s, temperature=POLICY_TEMPERATURE, logprobs=at_policy[i, : len(s.logprobs)].numpy())
        for i, s in enumerate(call[:2])
    ]
    mixed = [*policy_rows, *call[2:]]
    assert sorted({s.temperature for s in mixed}) == [CALL_TEMPERATURE, POLICY_TEMPERATURE]
    with torch.no_grad():
        tb, behav = token_batch(mixed, list(range(len(mixed))))
        assert tb.temperatures is not None and tb.temperatures.tolist() == [1.0, 1.0, 0.5, 0.5]
        _, stats = rank._forward_loss(tb, behav, torch.zeros(len(mixed)), None)
    assert stats.is_weight_mean == pytest.approx(1.0, abs=1e-4) and stats.is_truncated_frac == 0.0
