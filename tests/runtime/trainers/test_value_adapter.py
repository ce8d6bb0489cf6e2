"""A LoRA policy's critic (trainers/value_adapter.py): a second adapter and a value head on the policy's
own base, trained in the policy's step, checkpointed and offloaded with the rank, and invisible to
everything that reads the policy's adapter (CPU, gloo, world 1, a tiny Hugging Face model)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.trainers import deepspeed_trainer
from polyrl_runtime.trainers.adapter_engine import SharedBase
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer
from polyrl_runtime.trainers.lora import adapter_tensors
from polyrl_runtime.trainers.offload import rank_storages
from polyrl_runtime.trainers.shared_rank import AdapterTrainer, SharedBaseRank
from polyrl_runtime.trainers.value_adapter import ValueAdapterEngine
from polyrl_testenv.trainer_rank import OneLease, fixed_batch, in_process_rank

RESPONSE_LENGTHS = [1, 2, 6, 3]
REWARDS = [1.0, 0.0, 0.5, 1.0]
CPU = torch.device("cpu")


def _policy(model_dir: Path, name: str = "agent", critic: bool = True, stage: int = 1) -> Policy:
    algorithm: dict[str, Any] = {"name": "ppo", "groupSize": 1, "lr": 1e-3, "lora": {"rank": 4, "alpha": 8}}
    if critic:
        algorithm["critic"] = {"lr": 3e-2}
    return Policy.model_validate(
        {
            "name": name,
            "model": {"uri": f"file://{model_dir}", "dtype": "float32"},
            "algorithm": algorithm,
            "rollout": {"engine": "torch", "gpus": 0},
            "trainer": {"gpus": 0, "zeroStage": stage, "microBatchSize": 2},
        }
    )


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deepspeed_trainer, "ray", SimpleNamespace(get=lambda ref: ref))


def _step(rank: DeepSpeedTrainer, step: int) -> Any:
    rank.buffer = OneLease(fixed_batch(RESPONSE_LENGTHS, REWARDS))  # type: ignore[assignment]
    return rank.train_step(step, len(RESPONSE_LENGTHS), 2)


def _state(named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in named}


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys()
    return any(not torch.equal(a[k], b[k]) for k in a)


def _value_engine(rank: DeepSpeedTrainer) -> ValueAdapterEngine:
    assert rank.critic is not None
    engine = rank.critic.engine
    assert isinstance(engine, ValueAdapterEngine)
    return engine


@pytest.mark.parametrize("stage", [0, 2])
def test_the_critic_of_a_lora_policy_is_an_adapter_on_its_base_and_learns(
    gloo: None, no_ray: None, tiny_qwen2_dir: Path, stage: int
) -> None:
    rank = in_process_rank(_policy(tiny_qwen2_dir, stage=stage))
    value = _value_engine(rank)
    model: Any = rank.model
    # No second backbone: the critic trains the value adapter on the policy's model and its head.
    assert value.model is model and value.adapter == "agent_value"
    assert {"default", "agent_value"} <= set(model.peft_config)
    assert all(".lora_" in n and ".agent_value." in n for n, _ in value.named[:-2])
    assert [n for n, _ in value.named[-2:]] == ["value_head.weight", "value_head.bias"]
    assert model.active_adapter == "default"
    policy_adapter = _state([(n, p) for n, p in model.named_parameters() if ".default." in n])
    value_adapter = _state(value.named[:-2])

    losses = [_step(rank, step).value_loss for step in range(1, 7)]
    assert all(v > 0 for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses
    assert _changed(value_adapter, _state(value.named[:-2]))  # the adapter learnt, not the head alone
    # The policy trained its own adapter; outside the critic's calls its adapter is the one active,
    # so what export and publishing read is the policy's adapter alone.
    assert model.active_adapter == "default"
    assert _changed(policy_adapter, _state([(n, p) for n, p in model.named_parameters() if ".default." in n]))
    exported = adapter_tensors(model)
    assert exported and not any("agent_value" in n for n in exported)


def test_the_rank_checkpoint_and_offload_hold_the_value_adapter(
    gloo: None, no_ray: None, tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    rank = in_process_rank(_policy(tiny_qwen2_dir))
    value = _value_engine(rank)
    for step in (1, 2):
        _step(rank, step)
    rank.save(str(tmp_path), "trainer")
    saved = value.adapter_state()
    assert not torch.equal(saved["value_head.weight"], torch.zeros_like(saved["value_head.weight"]))

    again = in_process_rank(_policy(tiny_qwen2_dir))
    loaded = _value_engine(again)
    assert _changed(saved, loaded.adapter_state())
    again.load(str(tmp_path), "trainer")
    assert not _changed(saved, loaded.adapter_state())
    # The optimizer state came back too: both take the same next step.
    assert _step(again, 3).value_loss == pytest.approx(_step(rank, 3).value_loss, rel=1e-5)

    # Offloaded with the rank: the head and the critic's optimizer state (the value adapter is in the
    # policy's model, which the rank offloads anyway).
    held = rank_storages(rank.engine, rank.ref, CPU, value)
    assert len(held) > len(rank_storages(rank.engine, rank.ref, CPU))
    before = value.adapter_state()
    rank.offload()
    assert not rank_storages(rank.engine, rank.ref, CPU, value)
    rank.restore()
    assert not _changed(before, value.adapter_state())
    assert _step(rank, 4).value_loss > 0


def test_on_a_shared_base_the_critic_trains_only_its_own_adapter(
    gloo: None, no_ray: None, tiny_qwen2_dir: Path
) -> None:
    solver, other = _policy(tiny_qwen2_dir), _policy(tiny_qwen2_dir, "other", critic=False)
    shared = SharedBase.build([solver, other], seed=0, cuda=False, device=CPU)
    trainer = AdapterTrainer(
        "agent-trainer-0",
        solver.model_dump_json(by_alias=True),
        0,
        rank=0,
        world=1,
        buffer=None,  # type: ignore[arg-type]  # fed directly below
        base=lambda device: shared,
    )
    trainer.setup(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    value = _value_engine(trainer)
    assert value.model is shared.model
    assert not any("agent_value" in n for n, _ in shared.adapter_parameters("agent"))
    others = _state(shared.adapter_parameters("other"))
    before = value.adapter_state()
    solver_before = _state(shared.adapter_parameters("agent"))
    for step in (1, 2):
        trainer.buffer = OneLease(fixed_batch(RESPONSE_LENGTHS, REWARDS))  # type: ignore[assignment]
        with shared.active("agent"):
            result = trainer.train_step(step, len(RESPONSE_LENGTHS), 2)
        assert result.value_loss > 0
    model: Any = shared.model
    assert model.active_adapter == "agent"
    assert _changed(before, value.adapter_state())
    assert _changed(solver_before, _state(shared.adapter_parameters("agent")))
    assert not _changed(others, _state(shared.adapter_parameters("other")))


def test_a_shared_base_rank_offloads_a_critics_head_and_optimizer_with_the_base(
    gloo: None, no_ray: None, tiny_qwen2_dir: Path
) -> None:
    """SharedBaseRank parks the base, every adapter's optimizer and the LoRA critic's own head and
    optimizer in one offload; a restore gives them back bit for bit and the next step trains."""
    solver, other = _policy(tiny_qwen2_dir), _policy(tiny_qwen2_dir, "other", critic=False)

    def make(p: Policy) -> Any:
        def build(base: Any) -> AdapterTrainer:
            json = p.model_dump_json(by_alias=True)
            return AdapterTrainer(f"{p.name}-trainer-0", json, 0, rank=0, world=1, buffer=None, base=base)

        return build

    rank = SharedBaseRank({"agent": make(solver), "other": make(other)}, job_seed=0)
    trainer = rank._trainer("agent")
    dyn: Any = rank  # its per-policy methods are made from the trainer protocol

    async def go() -> None:
        for name in ("agent", "other"):
            await dyn.setup(name, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        trainer.buffer = OneLease(fixed_batch(RESPONSE_LENGTHS, REWARDS))  # type: ignore[assignment]
        assert (await dyn.train_step("agent", 1, len(RESPONSE_LENGTHS), 2)).value_loss > 0
        value = _value_engine(trainer)
        assert rank_storages(None, None, CPU, value)  # the head and the critic's optimizer state
        before = value.adapter_state()
        optimizer = [
            v.clone() for s in value.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        ]
        assert optimizer
        report = await rank.offload("other")  # any policy's call parks the whole base
        assert report.moved_bytes > 0 and not rank_storages(None, None, CPU, value)
        assert (await rank.offload("agent")).moved_bytes == 0  # parked already: the other calls find it so
        await rank.restore("agent")
        assert not _changed(before, value.adapter_state())
        restored = [v for s in value.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        assert all(torch.equal(a, b) for a, b in zip(optimizer, restored, strict=True))
        trainer.buffer = OneLease(fixed_batch(RESPONSE_LENGTHS, REWARDS))  # type: ignore[assignment]
        assert (await dyn.train_step("agent", 2, len(RESPONSE_LENGTHS), 2)).value_loss > 0

    asyncio.run(go())
