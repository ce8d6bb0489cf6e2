"""Trainer construction on CPU with gloo (world 1, in this process): ZeRO-3 partitions a Hugging Face
model as it loads and trains to the same weights as ZeRO-0; the reference model exists only with a KL
term and is partitioned like the trained one; gradient checkpointing changes no loss or gradient; the
learning rate follows warmup and cosine by training step (not optimizer step) and survives a checkpoint; dtype and DeepSpeed's
precision section agree. Pure parts (rank layout, lr factors, config) are table-driven."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from polyrl_operator.api import Algorithm, Policy
from polyrl_runtime.trainers.build import (
    Built,
    RankSlot,
    build_model,
    build_trainer,
    cuda_device_index,
    deepspeed_config,
    enable_gradient_checkpointing,
    hf_zero3_config,
    learning_rate,
    lr_factor,
    rank_layout,
)
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer
from polyrl_testenv.trainer_rank import in_process_rank

CPU = torch.device("cpu")


def _policy(uri: str, *, trainer: dict[str, Any] | None = None, **algorithm: Any) -> Policy:
    return Policy.model_validate(
        {
            "name": "agent",
            "model": {"uri": uri, "dtype": "float32"},
            "algorithm": {"lr": 1e-2, **algorithm},
            "rollout": {"engine": "torch", "gpus": 0},
            "trainer": {"gpus": 0, "zeroStage": 0, "microBatchSize": 4, **(trainer or {})},
        }
    )


@pytest.fixture
def hf_uri(tiny_qwen2_dir: Path) -> str:
    return f"file://{tiny_qwen2_dir}"


def _tokens() -> torch.Tensor:
    return torch.tensor([[5, 17, 99, 3, 250, 41, 7, 12], [9, 8, 7, 6, 5, 4, 3, 2]])


def _loss(model: Any) -> torch.Tensor:
    ids = _tokens()
    logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def _full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def _step(built: Built) -> None:
    built.engine.backward(_loss(built.engine))
    built.engine.step()


# -- pure parts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replicas", "per_pod", "expected"),
    [
        (1, 1, [(0, 0, 0)]),
        (1, 2, [(0, 0, 0), (1, 0, 1)]),
        (2, 1, [(0, 0, 0), (1, 1, 0)]),
        (2, 3, [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2)]),
    ],
)
def test_rank_layout(replicas: int, per_pod: int, expected: list[tuple[int, int, int]]) -> None:
    slots = rank_layout(replicas, per_pod)
    assert [(s.rank, s.pod, s.local_rank) for s in slots] == expected
    assert {s.world for s in slots} == {replicas * per_pod}
    assert slots == [RankSlot(r, p, lr, replicas * per_pod) for r, p, lr in expected]


def test_rank_layout_rejects_empty() -> None:
    with pytest.raises(ValueError, match="at least one pod"):
        rank_layout(0, 2)


@pytest.mark.parametrize(
    ("local_rank", "visible", "device"),
    [(0, 1, 0), (3, 1, 0), (0, 8, 0), (5, 8, 5)],  # Ray's one-GPU visibility, or the whole pod's
)
def test_cuda_device_index(local_rank: int, visible: int, device: int) -> None:
    assert cuda_device_index(local_rank, visible) == device


def test_cuda_device_index_errors() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        cuda_device_index(0, 0)
    with pytest.raises(ValueError, match="local rank 4 has no device"):
        cuda_device_index(4, 2)


@pytest.mark.parametrize(
    ("fields", "total", "expected"),
    [
        ({}, 5, [1.0, 1.0, 1.0, 1.0, 1.0]),
        ({"warmupSteps": 3}, 5, [0.25, 0.5, 0.75, 1.0, 1.0]),
        (
            {"lrSchedule": "cosine"},
            4,
            [1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 - 0.5 * math.cos(math.pi / 4), 0.0, 0.0],
        ),
        ({"lrSchedule": "cosine", "minLrRatio": 0.2, "warmupSteps": 1}, 3, [0.5, 1.0, 0.6, 0.2, 0.2]),
    ],
)
def test_lr_factor_per_step(fields: dict[str, Any], total: int, expected: list[float]) -> None:
    algo = Algorithm.model_validate(fields)
    assert [lr_factor(k, algo, total) for k in range(len(expected))] == pytest.approx(expected)


@pytest.mark.parametrize(
    ("dtype", "bf16", "fp16"),
    [(torch.float32, False, False), (torch.bfloat16, True, False), (torch.float16, False, True)],
)
def test_deepspeed_precision_matches_the_model_dtype(dtype: torch.dtype, bf16: bool, fp16: bool) -> None:
    p = _policy("builtin://tiny", maxGradNorm=0.5, trainer={"zeroStage": 2})
    cfg = deepspeed_config(p, dtype)
    assert (cfg["bf16"]["enabled"], cfg["fp16"]["enabled"]) == (bf16, fp16)
    assert cfg["gradient_clipping"] == 0.5 and cfg["zero_optimization"]["stage"] == 2


# -- construction ----------------------------------------------------------------------------------


def test_zero3_loads_a_hugging_face_model_partitioned(gloo: None, hf_uri: str, tiny_qwen2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    whole = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32)
    p = _policy(hf_uri, trainer={"zeroStage": 3})
    cfg = deepspeed_config(p, torch.float32)
    keep = hf_zero3_config(p, cfg)
    assert keep is not None
    model = build_model(p, 0, False, CPU, cfg)
    # partitioned at construction: no parameter holds its full tensor, each knows its full size
    for name, param in model.named_parameters():
        zero: Any = param  # ZeRO-3 adds ds_* attributes
        assert zero.numel() == 0, name
        assert zero.ds_numel == whole.get_parameter(name).numel(), name
    # and the shards hold the checkpoint's weights
    for name, full in _full_params(model).items():
        torch.testing.assert_close(full, whole.get_parameter(name).detach(), msg=name)
    stage2 = _policy(hf_uri, trainer={"zeroStage": 2})
    assert hf_zero3_config(stage2, deepspeed_config(stage2, torch.float32)) is None


def test_zero3_partitions_a_builtin_model_with_its_seeded_weights(gloo: None) -> None:
    from polyrl_runtime.models import load_model

    whole = load_model("builtin://tiny", seed=7)
    p = _policy("builtin://tiny", trainer={"zeroStage": 3})
    model = build_model(p, 7, False, CPU, deepspeed_config(p, torch.float32))
    assert all(q.numel() == 0 for q in model.parameters())
    for name, full in _full_params(model).items():
        torch.testing.assert_close(full, whole.get_parameter(name).detach(), msg=name)


def test_zero3_step_trains_to_the_same_weights_as_zero0(gloo: None, hf_uri: str) -> None:
    trained = {}
    for stage in (0, 3):
        built = build_trainer(
            _policy(hf_uri, trainer={"zeroStage": stage}), seed=1, cuda=False, device=CPU, total_steps=2
        )
        if stage == 3:
            assert all(p.numel() == 0 for p in built.engine.module.parameters())
        _step(built)
        trained[stage] = _full_params(built.engine.module)
        del built
    assert trained[0].keys() == trained[3].keys()
    # A key bias adds the same score to every key of a query, which softmax ignores: its true
    # gradient is 0 and Adam turns the rounding noise left in it into a full-size step of either sign.
    compared = [n for n in trained[0] if not n.endswith("k_proj.bias")]
    bad = [n for n in compared if not torch.allclose(trained[3][n], trained[0][n], rtol=1e-4, atol=1e-5)]
    assert not bad, bad
    initial = _full_params(
        build_model(_policy(hf_uri), 1, False, CPU, deepspeed_config(_policy(hf_uri), torch.float32))
    )
    moved = sum(not torch.equal(initial[n], trained[0][n]) for n in compared)
    assert moved > len(compared) // 2  # the step really changed the weights it is compared on


def test_reference_only_with_kl_and_partitioned_under_zero3(gloo: None, hf_uri: str) -> None:
    assert build_trainer(_policy(hf_uri), seed=0, cuda=False, device=CPU, total_steps=1).ref is None

    plain = build_trainer(_policy(hf_uri, klCoef=0.1), seed=0, cuda=False, device=CPU, total_steps=1)
    assert isinstance(plain.ref, torch.nn.Module) and not plain.ref.training
    trained = dict(plain.engine.module.named_parameters())
    for name, p in plain.ref.named_parameters():
        assert not p.requires_grad
        assert p.data_ptr() != trained[name].data_ptr()  # its own weights, not the trained ones
    with torch.no_grad():
        before = _loss(plain.ref)
    _step(plain)
    with torch.no_grad():
        assert torch.equal(_loss(plain.ref), before)  # training leaves the reference where it was
        assert not torch.equal(_loss(plain.engine), before)

    z3 = build_trainer(
        _policy(hf_uri, klCoef=0.1, trainer={"zeroStage": 3}), seed=0, cuda=False, device=CPU, total_steps=1
    )
    from deepspeed import DeepSpeedEngine

    assert isinstance(z3.ref, DeepSpeedEngine) and z3.ref.optimizer is not None
    assert all(p.numel() == 0 and p.ds_numel > 0 for p in z3.ref.module.parameters())
    with torch.no_grad():
        torch.testing.assert_close(_loss(z3.ref), before)  # the initial policy, gathered on the fly


def test_gradient_checkpointing_is_on_and_changes_no_loss_or_gradient(gloo: None, hf_uri: str) -> None:
    results = []
    for checkpointing in (False, True):
        p = _policy(hf_uri, trainer={"gradientCheckpointing": checkpointing})
        built = build_trainer(p, seed=0, cuda=False, device=CPU, total_steps=1)
        module = built.engine.module
        assert module.is_activation_checkpointing is checkpointing
        module.train()
        loss = _loss(module)
        torch.autograd.backward(loss)
        results.append((loss.detach(), {n: q.grad.clone() for n, q in module.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0)
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, msg=name)


def test_gradient_checkpointing_on_a_builtin_model_is_reported_unsupported() -> None:
    from polyrl_runtime.models import load_model

    model = load_model("builtin://tiny")
    assert enable_gradient_checkpointing(model, _policy("builtin://tiny")) is False


@pytest.mark.parametrize("stage", [0, 3])
def test_ppo_learning_rate_follows_training_steps_and_resumes_from_a_checkpoint(
    gloo: None, hf_uri: str, tmp_path: Path, stage: int
) -> None:
    """ppo takes one optimizer step per micro-batch (four here): every one of them in training step k
    uses the schedule's rate at k, and a resumed rank continues the schedule at its step."""
    fields = {"name": "ppo", "warmupSteps": 2, "lrSchedule": "cosine", "minLrRatio": 0.1}
    p = _policy(hf_uri, trainer={"zeroStage": stage}, **fields)
    total, micro = 6, 4
    expected = [learning_rate(k, p.algorithm, total) for k in range(total)]
    assert len(set(expected)) == total

    def train(rank: DeepSpeedTrainer, step: int) -> None:
        before = rank.engine.global_steps
        result = rank.train_step(step, 0, micro)
        assert rank.engine.global_steps == before + micro  # optimizer steps of this training step
        assert result.lr == pytest.approx(expected[step - 1])
        assert [g["lr"] for g in rank.engine.optimizer.param_groups] == pytest.approx([expected[step - 1]])

    rank = in_process_rank(p, total)
    for step in range(1, 5):
        train(rank, step)
    rank.save(str(tmp_path), "s4")

    resumed = in_process_rank(p, total)
    resumed.load(str(tmp_path), "s4")
    assert resumed.version == 4
    for step in (5, 6):
        train(resumed, step)


def test_model_dtype_is_honoured(gloo: None, hf_uri: str) -> None:
    p = _policy(hf_uri).model_copy(
        update={"model": _policy(hf_uri).model.model_copy(update={"dtype": "bfloat16"})}
    )
    built = build_trainer(p, seed=0, cuda=False, device=CPU, total_steps=1)
    assert built.config["bf16"]["enabled"]
    assert {q.dtype for q in built.engine.module.parameters()} == {torch.bfloat16}
    _step(built)
