"""LoRA through peft on the tiny Hugging Face Qwen2: adapters only, merged weights, the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.trainers.lora import (
    LoraError,
    adapter_tensors,
    apply_lora,
    reference_model,
    serving_tensors,
)


def _policy(uri: str, **lora: Any) -> Policy:
    return Policy.model_validate({"name": "solver", "model": {"uri": uri}, "algorithm": {"lora": lora}})


def _hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model


def _trained(path: Path, steps: int = 3, **lora: Any) -> torch.nn.Module:
    """A peft model after a few AdamW steps on a language-modelling loss (B starts at zero, so
    without steps the merged weights would equal the base ones)."""
    torch.manual_seed(0)
    model = apply_lora(_hf(path), _policy(f"file://{path}", rank=4, alpha=8, **lora))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(3, 300, (2, 12))
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids).logits
    return out


def test_only_adapters_require_grad(tiny_qwen2_dir: Path) -> None:
    model = apply_lora(_hf(tiny_qwen2_dir), _policy(f"file://{tiny_qwen2_dir}", targetModules=["q_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all("q_proj" in n for n in trainable)
    assert len(trainable) == 2 * 2  # A and B of q_proj in each of the two layers


def test_merged_weights_load_into_a_fresh_model(tiny_qwen2_dir: Path) -> None:
    model = _trained(tiny_qwen2_dir)
    adapters = adapter_tensors(model)
    merged = dict(serving_tensors(model))
    fresh = _hf(tiny_qwen2_dir)
    # Exactly the served model's parameters: names, shapes, tied lm_head once, no buffers.
    assert {n: tuple(p.shape) for n, p in fresh.named_parameters()} == {
        n: tuple(t.shape) for n, t in merged.items()
    }
    ids = torch.randint(3, 300, (3, 10))
    base_logits = _logits(fresh, ids)
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            p.copy_(merged[n])
    expected = _logits(model, ids)
    assert not torch.allclose(base_logits, expected, atol=1e-4)  # the adapters did learn something
    torch.testing.assert_close(_logits(fresh, ids), expected, atol=1e-5, rtol=1e-5)
    # Merging left the adapters and the peft model untouched.
    for n, t in adapter_tensors(model).items():
        assert torch.equal(t, adapters[n])
    torch.testing.assert_close(_logits(model, ids), expected)


def test_reference_is_the_base_model(tiny_qwen2_dir: Path) -> None:
    model = _trained(tiny_qwen2_dir)
    ids = torch.randint(3, 300, (2, 9))
    base = _logits(_hf(tiny_qwen2_dir), ids)
    with reference_model(model):
        torch.testing.assert_close(_logits(model, ids), base)
    assert not torch.allclose(_logits(model, ids), base, atol=1e-4)


def test_unknown_target_module_names_policy_field_and_modules(tiny_qwen2_dir: Path) -> None:
    policy = _policy(f"file://{tiny_qwen2_dir}", targetModules=["q_proj", "query_key_value"])
    with pytest.raises(LoraError) as e:
        apply_lora(_hf(tiny_qwen2_dir), policy)
    msg = str(e.value)
    assert "policy solver" in msg and "algorithm.lora.targetModules" in msg
    assert "query_key_value" in msg
    assert "q_proj" in msg.split("are:")[1] and "down_proj" in msg


def test_module_kind_lora_cannot_wrap(tiny_qwen2_dir: Path) -> None:
    with pytest.raises(LoraError, match=r"policy solver: algorithm\.lora\.targetModules"):
        apply_lora(
            _hf(tiny_qwen2_dir), _policy(f"file://{tiny_qwen2_dir}", targetModules=["input_layernorm"])
        )


def test_tied_embeddings_cannot_be_adapted(tiny_qwen2_dir: Path) -> None:
    with pytest.raises(LoraError, match="tie_word_embeddings"):
        apply_lora(_hf(tiny_qwen2_dir), _policy(f"file://{tiny_qwen2_dir}", targetModules=["lm_head"]))


def test_all_linear_alone(tiny_qwen2_dir: Path) -> None:
    with pytest.raises(LoraError, match="all-linear cannot be combined"):
        apply_lora(
            _hf(tiny_qwen2_dir), _policy(f"file://{tiny_qwen2_dir}", targetModules=["all-linear", "q_proj"])
        )


def test_builtin_toy_model_is_rejected() -> None:
    from polyrl_runtime.models import load_model

    with pytest.raises(LoraError, match=r"policy solver: algorithm\.lora needs a Hugging Face model"):
        apply_lora(load_model("builtin://tiny"), _policy("builtin://tiny"))


def test_without_lora_the_model_is_unchanged(tiny_qwen2_dir: Path) -> None:
    model = _hf(tiny_qwen2_dir)
    policy = Policy.model_validate({"name": "solver", "model": {"uri": f"file://{tiny_qwen2_dir}"}})
    assert apply_lora(model, policy) is model
    assert [n for n, _ in serving_tensors(model)] == [n for n, _ in model.named_parameters()]


def test_adapters_of_a_bfloat16_base_are_published_in_bfloat16(tiny_qwen2_dir: Path) -> None:
    """peft trains them in float32; the engines hold them in the base's dtype (their manifest check
    refuses any other), so that is what a weight update carries."""
    from transformers import AutoModelForCausalLM

    from polyrl_runtime.trainers.publish import adapter_tensors as published

    base = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.bfloat16)
    model = apply_lora(base, _policy(f"file://{tiny_qwen2_dir}", rank=4))
    trained = {p.dtype for n, p in model.named_parameters() if ".lora_" in n}
    assert trained == {torch.float32}
    tensors = published(model)
    assert tensors and {t.dtype for t in tensors.values()} == {torch.bfloat16}
