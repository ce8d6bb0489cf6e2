"""A tiny Hugging Face Qwen2 built in code: the real-model path of the CPU examples and tests.

`create_tiny_qwen2(DIR)` writes an ordinary Hugging Face model directory — `config.json`,
`generation_config.json`, `model.safetensors`, and a byte-level BPE tokenizer trained here on a small
fixed corpus, with a ChatML chat template that renders `tools` as Qwen2.5's does — which then loads
through `AutoModelForCausalLM` / `AutoTokenizer` exactly like a downloaded checkpoint. Nothing
downstream special-cases it.

The build is deterministic (fixed corpus, fixed seed), so every process that materialises
`builtin://tiny-qwen2` gets the same weights and the same token ids. Word embeddings are tied to the
output head as in the small Qwen2.5 checkpoints, so weight sync sees a tied parameter.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import string
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl_runtime.waiting import lock_deadline_s, locked

EOS = "<|im_end|>"
PAD = "<|endoftext|>"
SPECIALS = (PAD, "<|im_start|>", EOS)
# ChatML; with `tools`, first a system block laid out as Qwen2.5's own template does it: a leading
# system message, then the JSON schema of each tool, one a line, inside <tools></tools>, and the
# Hermes tool-call format the parser reads (workflows/tools.py). Qwen2.5's instructions are
# shortened: this tokenizer spends about one token per character of JSON (the calculator's schema
# is ~270 tokens) and Qwen's full text alone would be ~350 more. HF renders templates with trim_blocks,
# so the newlines that follow a block tag are written as {{ '\n' }}. Without tools, the rendering (and
# so every token count) is plain ChatML.
CHAT_TEMPLATE = (
    "{% set merged = tools and messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if merged %}{{ messages[0]['content'] }}{{ '\\n\\n' }}{% endif %}"
    "# Tools{{ '\\n\\n' }}<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>{{ '\\n\\n' }}For each function call, return "
    "<tool_call>{{ '\\n' }}{\"name\": <function-name>, \"arguments\": <args-json-object>}{{ '\\n' }}</tool_call>"
    "<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for message in messages %}{% if not (merged and loop.first) %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Bumped whenever the build changes (weights, tokenizer, chat template), so a cached directory from
# another build is never reused: `materialise` keys the cache by it.
BUILD = 2


@dataclass(frozen=True)
class TinyQwen2Size:
    hidden_size: int = 96
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 320
    # Room for a tool schema in the prompt (about 300 tokens each with this tokenizer). The weights do
    # not depend on it (rotary positions have no parameters).
    max_position_embeddings: int = 2048


SIZES = {"tiny-qwen2": TinyQwen2Size()}


def _corpus() -> list[str]:
    """Text the BPE merges are learned from: the examples' prompts and answers, chat roles, words."""
    words = [
        "the",
        "answer",
        "is",
        "see",
        "say",
        "hello",
        "world",
        "user",
        "assistant",
        "system",
        "question",
        "reply",
        "yes",
        "no",
        "agent",
        "speaker",
        "listener",
        "guess",
        "number",
        "digit",
        "symbol",
        "message",
        "think",
        "final",
        "result",
    ]
    lines = [f"see:{d} answer:{e}" for d in string.digits for e in string.digits]
    lines += [f"{a} {b}" for a in words for b in words[:8]]
    lines += [f"{x} + {y} = {x + y}" for x in range(20) for y in range(10)]
    lines += [string.ascii_lowercase, string.ascii_uppercase, string.punctuation]
    return lines


def _tokenizer() -> Any:
    transformers: Any = importlib.import_module("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SIZES["tiny-qwen2"].vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=SIZES["tiny-qwen2"].max_position_embeddings,
    )


def create_tiny_qwen2(
    directory: Path | str, *, name: str = "tiny-qwen2", seed: int = 0, size: TinyQwen2Size | None = None
) -> Path:
    """Write the model directory `directory` (created; its parent must exist or be creatable): the
    built-in `name`, or with `size` a model of that shape (same tokenizer and template)."""
    import torch

    transformers: Any = importlib.import_module("transformers")

    if size is None and name not in SIZES:
        raise ValueError(f"unknown built-in Hugging Face model builtin://{name}; known: {sorted(SIZES)}")
    size = size or SIZES[name]
    transformers.utils.logging.disable_progress_bar()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    eos, pad = int(tok.convert_tokens_to_ids(EOS)), int(tok.convert_tokens_to_ids(PAD))
    config = transformers.Qwen2Config(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        max_position_embeddings=size.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    model.generation_config = transformers.GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    # the kernel releases it if the holder dies; a wait for a live holder is logged
    with open(path, "a+b") as f, locked(f, path, what="built-in model cache", deadline_s=lock_deadline_s()):
        yield


def cache_root() -> Path:
    """Where built-in models are materialised: $POLYRL_CACHE/models (default ~/.cache/polyrl)."""
    base = os.environ.get("POLYRL_CACHE") or str(Path.home() / ".cache" / "polyrl")
    return Path(base) / "models"


def materialise(name: str) -> Path:
    """The directory of `builtin://NAME`, built once per machine (concurrent callers wait for one
    build; a build is written to a temporary directory and renamed, so a killed build leaves no
    half-written model behind)."""
    if name not in SIZES:
        raise ValueError(f"unknown built-in Hugging Face model builtin://{name}; known: {sorted(SIZES)}")
    root = cache_root()
    final = root / f"{name}-b{BUILD}"
    if (final / "config.json").is_file():
        return final
    with _locked(root / f".{name}.lock"):
        if (final / "config.json").is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            create_tiny_qwen2(tmp, name=name)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
