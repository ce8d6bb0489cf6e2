"""Hugging Face exports and LoRA in a real DeepSpeed trainer (CPU, gloo, world 1, ZeRO-2)."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.algorithms.losses import TokenBatch
from polyrl_runtime.models import load_model, load_tokenizer
from polyrl_runtime.netmap import free_port
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer
from polyrl_runtime.trainers.export import BUILTIN_MANIFEST, export_due, export_location, export_policy
from polyrl_runtime.trainers.lora import serving_tensors


def _policy(model_dir: Path, **algorithm: Any) -> Policy:
    return Policy.model_validate(
        {
            "name": "solver",
            "model": {"uri": f"file://{model_dir}", "dtype": "float32"},
            "algorithm": {"lr": 1e-2, **algorithm},
            "trainer": {"gpus": 0, "zeroStage": 2, "microBatchSize": 4},
        }
    )


def _trainer(policy: Policy) -> DeepSpeedTrainer:
    trainer = DeepSpeedTrainer(
        "solver-trainer-0", policy.model_dump_json(by_alias=True), 0, rank=0, world=1, buffer=None
    )
    trainer.setup("127.0.0.1", free_port())  # joins the group the first trainer created
    return trainer


def _step(trainer: DeepSpeedTrainer, seed: int = 0) -> None:
    """One optimizer step of a language-modelling loss through the trainer's DeepSpeed engine."""
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(seed))
    loss = trainer.engine(input_ids=ids, labels=ids).loss
    trainer.engine.backward(loss)
    trainer.engine.step()


def _hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids).logits
    return out


def _check_tokenizer(directory: Path) -> None:
    tok = load_tokenizer(f"file://{directory}")
    assert tok.has_chat_template and tok.eos_id == 2
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.training  # a DeepSpeed engine trains a step in this process
def test_export_has_the_trained_weights_and_the_tokenizer(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    initial = dict(_hf(tiny_qwen2_dir).named_parameters())
    trainer = _trainer(_policy(tiny_qwen2_dir))
    _step(trainer)
    out = Path(export_location(tmp_path, 1, "solver"))
    trainer.export(str(out))
    trained = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters()}
    exported = dict(_hf(out).named_parameters())
    assert exported.keys() == trained.keys() == initial.keys()
    for name, p in exported.items():
        assert torch.equal(p, trained[name]), name
    assert any(not torch.equal(exported[n], initial[n]) for n in initial)
    assert not any(p.name.endswith(".tmp") for p in out.parent.iterdir())
    _check_tokenizer(out)


def _kl(trainer: DeepSpeedTrainer) -> float:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, 6).astype(np.int32) for _ in range(2)]
    responses = [rng.integers(3, 300, 5).astype(np.int32) for _ in range(2)]
    tb = TokenBatch.build(prompts, responses, [np.zeros(0, np.int32)] * 2)
    behav = torch.zeros(tb.targets.shape)
    with torch.no_grad():
        _, stats = trainer._forward_loss(tb, behav, torch.ones(2), None)
    return float(stats.kl)


def test_lora_trainer_trains_adapters_and_exports_merged_weights(
    tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    import peft

    policy = _policy(
        tiny_qwen2_dir, klCoef=0.1, lora={"rank": 4, "alpha": 8, "targetModules": ["all-linear"]}
    )
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    base_logits = _logits(_hf(tiny_qwen2_dir), ids)
    trainer = _trainer(policy)
    assert trainer.ref is None  # no second model: the reference is the base with adapters off
    assert _kl(trainer) == 0.0  # B starts at zero: the policy is the reference
    _step(trainer)
    assert _kl(trainer) > 0.0
    module = trainer.engine.module
    served = dict(serving_tensors(module))
    published = trainer.weight_tensors()  # what weight sync sends: the served model's parameters
    assert list(published) == [n for n, _ in _hf(tiny_qwen2_dir).named_parameters()]
    assert all(torch.equal(published[n], t) for n, t in served.items())
    trained_logits = _logits(module, ids)
    out = Path(export_location(tmp_path, 1, "solver"))
    trainer.export(str(out))
    # The resumable checkpoint stores the adapters and optimizer state, not the frozen base.
    trainer.save(str(tmp_path / "ckpt"), "ckpt")
    _step(trainer, seed=2)
    assert not torch.equal(
        dict(serving_tensors(module))["model.layers.0.mlp.up_proj.weight"],
        served["model.layers.0.mlp.up_proj.weight"],
    )
    trainer.load(str(tmp_path / "ckpt"), "ckpt")
    for name, t in serving_tensors(module):
        assert torch.equal(t, served[name]), name
    states = torch.load(tmp_path / "ckpt" / "ckpt" / "mp_rank_00_model_states.pt", weights_only=False)
    # DeepSpeed drops frozen parameters by their first name; a tied alias (lm_head) stays.
    assert {k for k in states["module"] if ".lora_" not in k} <= {"base_model.model.lm_head.weight"}
    assert sum(".lora_" in k for k in states["module"]) == 2 * 7 * 2  # A, B x 7 projections x 2 layers
    exported = _hf(out)
    assert not torch.allclose(trained_logits, base_logits, atol=1e-4)
    torch.testing.assert_close(_logits(exported, ids), trained_logits, atol=1e-5, rtol=1e-5)
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 4
    adapted = peft.PeftModel.from_pretrained(_hf(tiny_qwen2_dir), str(out / "adapter")).eval()
    torch.testing.assert_close(_logits(adapted, ids), trained_logits, atol=1e-5, rtol=1e-5)
    _check_tokenizer(out)


def test_builtin_toy_exports_its_parameters(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = load_model("builtin://tiny", seed=3)
    out = export_policy(model, tmp_path / "solver", source_dir=None, source_uri="builtin://tiny")
    assert out is not None
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(saved[n], p) for n, p in model.named_parameters())
    assert json.loads((out / BUILTIN_MANIFEST).read_text())["uri"] == "builtin://tiny"


def test_only_the_writer_writes(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    out = export_policy(
        _hf(tiny_qwen2_dir), tmp_path / "x", source_dir=tiny_qwen2_dir, source_uri="u", writer=False
    )
    assert out is None and not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("step", "every", "due"),
    [(5, None, False), (10, None, True), (4, 2, True), (5, 2, False), (10, 3, True), (12, 3, True)],
)
def test_export_due(step: int, every: int | None, due: bool) -> None:
    assert export_due(step, 10, every) is due


def test_export_location_layout(tmp_path: Path) -> None:
    assert export_location(tmp_path, 40, "solver") == str(tmp_path / "export" / "step-000040" / "solver")
    assert export_location("s3://b/ck", 7, "solver") == "s3://b/ck/export/step-000007/solver"


def test_zero3_lora_export_gathers_the_partitioned_weights(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    integration: Any = importlib.import_module("transformers.integrations.deepspeed")

    policy = _policy(tiny_qwen2_dir, lora={"rank": 4, "alpha": 8, "targetModules": ["q_proj", "down_proj"]})
    policy.trainer.zero_stage = 3
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    trainer = _trainer(policy)
    try:
        module = trainer.engine.module
        assert all(p.numel() == 0 for p in module.parameters())  # partitioned (world 1: held elsewhere)
        _step(trainer)
        with torch.no_grad():
            trained_logits = trainer.engine(input_ids=ids).logits
        out = Path(export_location(tmp_path, 1, "solver"))
        trainer.export(str(out))
    finally:
        integration.unset_hf_deepspeed_config()  # later from_pretrained calls must build whole models
    base_logits = _logits(_hf(tiny_qwen2_dir), ids)
    assert not torch.allclose(trained_logits, base_logits, atol=1e-4)
    torch.testing.assert_close(_logits(_hf(out), ids), trained_logits, atol=1e-5, rtol=1e-5)


def test_the_driver_exports_every_n_steps_and_at_the_end(
    ray_session: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    import yaml
    from safetensors.torch import load_file

    from polyrl_operator.api import RLJob
    from polyrl_runtime.coordinator.driver import Driver, DriverOptions

    monkeypatch.setenv(
        "TORCH_EXTENSIONS_DIR",
        os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "polyrl" / "torch_extensions")),
    )
    doc = yaml.safe_load((Path(__file__).parents[1] / "data" / "selfplay-tiny.yaml").read_text())
    doc["spec"]["training"]["totalSteps"] = 3
    doc["spec"]["checkpoint"] = {"everySteps": 10, "keep": 1, "exportEvery": 2}
    driver = Driver(
        RLJob.model_validate(doc),
        DriverOptions(
            out_dir=tmp_path, checkpoint_root=tmp_path / "ckpt", place_by_resource=False, poll_s=0.2
        ),
    )
    try:
        summary = asyncio.run(driver.run())
    finally:
        driver.close()
    assert summary.state == "done", summary.message
    exports = tmp_path / "ckpt" / "export"
    assert sorted(p.name for p in exports.iterdir()) == ["step-000002", "step-000003"]  # every 2, and the end
    names = {n for n, _ in load_model("builtin://tiny").named_parameters()}
    for step in exports.iterdir():
        assert load_file(str(step / "agent" / "model.safetensors")).keys() == names
        assert json.loads((step / "agent" / BUILTIN_MANIFEST).read_text())["uri"] == "builtin://tiny"
    last = load_file(str(exports / "step-000003" / "agent" / "model.safetensors"))
    first = load_file(str(exports / "step-000002" / "agent" / "model.safetensors"))
    assert any(not torch.equal(last[n], first[n]) for n in last)  # step 3 trained past step 2
