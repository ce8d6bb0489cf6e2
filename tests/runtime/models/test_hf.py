"""Hugging Face models and tokenizers by URI: dtype, attention, the tokenizer adapter, the built-in
tiny Qwen2, trust_remote_code and the errors a user sees for bad model directories."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from polyrl_runtime.models import ModelLoadError, context_limit, load_model, load_tokenizer, model_dir
from polyrl_runtime.models.tiny_qwen2 import create_tiny_qwen2


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("auto", torch.float32),
    ],
)
def test_load_model_honours_the_dtype(tiny_qwen2_dir: Path, dtype: str, expected: torch.dtype) -> None:
    model: Any = load_model(f"file://{tiny_qwen2_dir}", dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.config._attn_implementation == "sdpa"
    assert context_limit(model) == 2048


def test_auto_dtype_is_bfloat16_for_gpu_placement(tiny_qwen2_dir: Path) -> None:
    model = load_model(f"file://{tiny_qwen2_dir}", dtype="auto", cuda=True)  # loaded on CPU, typed for GPU
    assert next(model.parameters()).dtype == torch.bfloat16


def test_tokenizer_adapter_exposes_end_ids_pad_and_chat_template(tiny_qwen2_dir: Path) -> None:
    tok = load_tokenizer(f"file://{tiny_qwen2_dir}")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_qwen2_dir))
    assert tok.eos_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.stop_ids == (tok.eos_id, hf.convert_tokens_to_ids("<|endoftext|>"))  # + generation_config's
    assert tok.pad_id == hf.pad_token_id
    assert tok.has_chat_template
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "see:3"}]
    ids = tok.apply_chat_template(messages)
    assert ids == hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids, skip_special=False).endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("the answer is 42")) == "the answer is 42"
    with pytest.raises(KeyError, match="not one token"):
        tok.token_id("the answer is")


def test_builtin_tiny_qwen2_is_materialised_once_and_loads_like_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_qwen2_dir: Path
) -> None:
    monkeypatch.setenv("POLYRL_CACHE", str(tmp_path / "cache"))
    path = model_dir("builtin://tiny-qwen2")
    assert path.is_relative_to(tmp_path / "cache") and (path / "model.safetensors").is_file()
    assert model_dir("builtin://tiny-qwen2") == path
    # The build is deterministic: the same weights and tokenizer as any other build.
    ours, theirs = load_file(path / "model.safetensors"), load_file(tiny_qwen2_dir / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (path / "tokenizer.json").read_text() == (tiny_qwen2_dir / "tokenizer.json").read_text()
    model = load_model("builtin://tiny-qwen2")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert load_tokenizer("builtin://tiny-qwen2").has_chat_template


def test_create_tiny_command_writes_a_model_directory(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "polyrl_operator.cli", "models", "create-tiny", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"file://{tmp_path / 'm'}" in out.stdout
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "m")).model_type == "qwen2"


def test_missing_or_foreign_model_directories_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(
        ModelLoadError, match=r"file:///nowhere/model: model directory /nowhere/model does not exist"
    ):
        load_model("file:///nowhere/model")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a Hugging Face model directory"):
        load_tokenizer(f"file://{tmp_path}")
    with pytest.raises(ModelLoadError, match="builtin://tiny-llama: not a Hugging Face model"):
        model_dir("builtin://tiny-llama")


def test_a_chat_template_is_required_only_when_used(tmp_path: Path, tiny_qwen2_dir: Path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(tiny_qwen2_dir, plain)
    (plain / "chat_template.jinja").unlink()
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(f"file://{plain}")
    assert tok.encode("see:3")  # plain-text prompts still work
    with pytest.raises(ModelLoadError, match=rf"file://{plain}: the tokenizer has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer("builtin://tiny").apply_chat_template([{"role": "user", "content": "hi"}])


CUSTOM_CODE = """
import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class BigramConfig(PretrainedConfig):
    model_type = "polyrl-bigram"

    def __init__(self, vocab_size=16, **kwargs):
        self.vocab_size = vocab_size
        super().__init__(**kwargs)


class BigramLM(PreTrainedModel):
    config_class = BigramConfig

    def __init__(self, config):
        super().__init__(config)
        self.table = torch.nn.Embedding(config.vocab_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return CausalLMOutput(logits=self.table(input_ids))
"""


def test_code_shipped_with_a_model_runs_only_with_trust_remote_code(tmp_path: Path) -> None:
    (tmp_path / "bigram.py").write_text(textwrap.dedent(CUSTOM_CODE))
    sys.path.insert(0, str(tmp_path))
    try:
        import bigram  # type: ignore[import-not-found]

        bigram.BigramConfig.register_for_auto_class()
        bigram.BigramLM.register_for_auto_class("AutoModelForCausalLM")
        bigram.BigramLM(bigram.BigramConfig()).save_pretrained(str(tmp_path / "model"))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("bigram", None)
    uri = f"file://{tmp_path / 'model'}"
    with pytest.raises(ModelLoadError, match=r"set model.trustRemoteCode: true"):
        load_model(uri)
    model = load_model(uri, trust_remote_code=True)
    assert type(model).__name__ == "BigramLM"


def test_the_tiny_qwen2_ties_its_output_head_to_the_embeddings(tmp_path: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(create_tiny_qwen2(tmp_path / "m")))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())
