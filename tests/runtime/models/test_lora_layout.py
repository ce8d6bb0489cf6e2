"""An adapter's tensors on a shared base (`models/lora_layout.py`) are exactly the ones peft makes for
the same `algorithm.lora`: names, shapes and the modules `targetModules` selects."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from polyrl_operator.api import Lora
from polyrl_runtime.models.lora_layout import AdapterLayoutError, adapter_layout

PREFIX = "base_model.model."


def _model(model_dir: Path) -> torch.nn.Module:
    model: torch.nn.Module = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model


@pytest.mark.parametrize(
    "lora",
    [
        Lora(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
        Lora(rank=8, alpha=12, target_modules=["all-linear"]),
        Lora(rank=2, alpha=2, target_modules=["mlp.up_proj"]),
    ],
    ids=["names", "all-linear", "dotted-suffix"],
)
def test_the_layout_is_the_tensors_peft_makes(tiny_qwen2_dir: Path, lora: Lora) -> None:
    targets = "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets)
    peft_model = get_peft_model(_model(tiny_qwen2_dir), config)
    want = {k.removeprefix(PREFIX): tuple(v.shape) for k, v in get_peft_model_state_dict(peft_model).items()}
    layout = adapter_layout(_model(tiny_qwen2_dir), "solver", lora)
    assert layout.shapes() == want
    assert layout.scaling == lora.alpha / lora.rank
    assert layout.nbytes(4) == 4 * sum(a * b for a, b in want.values())


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (
            ["q_proj", "attention_dense"],
            "the model has no module named attention_dense; its linear layers are: ",
        ),
        (["all-linear", "q_proj"], "all-linear cannot be combined with module names"),
        (["embed_tokens"], "model.embed_tokens (Embedding) is not a linear layer"),
    ],
)
def test_targets_that_cannot_be_laid_out_name_the_policy_and_field(
    tiny_qwen2_dir: Path, targets: list[str], message: str
) -> None:
    with pytest.raises(AdapterLayoutError) as err:
        adapter_layout(_model(tiny_qwen2_dir), "verifier", Lora(target_modules=targets))
    assert str(err.value).startswith("policy verifier: algorithm.lora.targetModules: ")
    assert message in str(err.value)
