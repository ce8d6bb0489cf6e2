"""Small GGUF files written in code, as llama.cpp's converter lays them out, for the GGUF tests.

`write_gguf(model_dir, out)` turns a Hugging Face model directory built in code (a Llama or a Qwen2
with the tiny Qwen2's byte-level BPE tokenizer and chat template) into a GGUF file with the `gguf`
package: the config under llama.cpp's key names, the tokenizer as `gpt2` tokens and merges with the
special tokens marked as control tokens, the chat template, and every tensor under llama.cpp's name
(Llama's query and key rows permuted as llama.cpp permutes them). Tensors are float32 unless
`quantise` names a type (`Q8_0`, ...), applied to the matrices as llama.cpp does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers

ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}


def build_model(arch: str, directory: Path, *, seed: int = 0) -> Path:
    """A tiny `arch` model (the built-in tiny Qwen2's shape, tokenizer and template; a Llama takes its
    config's fields), its weights drawn at std 0.15 so that logits differ visibly between positions,
    saved as a Hugging Face directory."""
    from polyrl_runtime.models.tiny_qwen2 import create_tiny_qwen2

    create_tiny_qwen2(directory, seed=seed)
    config: Any = transformers.AutoConfig.from_pretrained(str(directory))
    if arch == "llama":
        config = transformers.LlamaConfig(**{k: v for k, v in config.to_dict().items() if k != "model_type"})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.15) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    (directory / "model.safetensors").unlink()
    model.save_pretrained(str(directory))
    return directory


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for Llama's query and key projections (rotary pairs interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path, *, quantise: str | None = None) -> Path:
    """The GGUF file of the Llama or Qwen2 directory `model_dir`, written to `out`."""
    config = json.loads((model_dir / "config.json").read_text())
    arch_name = config["model_type"]
    arch = ARCHS[arch_name]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(f"tiny-{arch_name}")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if quantise is None else gguf.LlamaFileType.MOSTLY_Q8_0)

    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {str(t) for t in tok.added_tokens_decoder.values()}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(
        [int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL) for t in tokens]
    )
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(int(tok.eos_token_id))
    w.add_pad_token_id(int(tok.pad_token_id))
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)

    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # llama.cpp writes the output projection only when it is not the embedding
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = tensor.numpy().astype(np.float32)
        if arch_name == "llama" and name.endswith("attn_q.weight"):
            data = _permute(data, heads)
        elif arch_name == "llama" and name.endswith("attn_k.weight"):
            data = _permute(data, kv_heads)
        if quantise is not None and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quantise]
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_with_tensor_type(out: Path, arch: str, qtype: str) -> Path:
    """A header-valid GGUF whose one tensor is declared as `qtype` (raw bytes of the right size)."""
    t = gguf.GGMLQuantizationType[qtype]
    block, type_size = gguf.GGML_QUANT_SIZES[t]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 256 // block * type_size), np.uint8), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
