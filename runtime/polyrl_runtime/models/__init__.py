"""Models and tokenizers by URI: `builtin://NAME` (no download) or a Hugging Face directory.

`builtin://tiny` and `builtin://small` are the plain-torch toy models with a character tokenizer;
`builtin://tiny-qwen2` is a Hugging Face model built in code and materialised as an ordinary model
directory, then loaded through the same `from_pretrained` path as any checkpoint (`model_dir`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from polyrl_runtime import storage
from polyrl_runtime.models.hf import HFTokenizer, ModelLoadError, load_hf_model, resolve_dtype
from polyrl_runtime.models.tiny_qwen2 import SIZES as HF_BUILTINS
from polyrl_runtime.models.tiny_qwen2 import materialise
from polyrl_runtime.models.tokenizer import CharTokenizer

if TYPE_CHECKING:
    import torch

# torch is imported by `load_model` and the model modules (`tiny`, `hf.load_hf_model`), never by this
# package: the driver and workflow workers use its tokenizers and errors only
# (tests/runtime/test_startup_imports.py).
__all__ = [
    "CharTokenizer",
    "HFTokenizer",
    "ModelLoadError",
    "Tokenizer",
    "context_limit",
    "load_model",
    "load_tokenizer",
    "local_path",
    "model_dir",
    "resolve_dtype",
]


class Tokenizer(Protocol):
    """What workflows and engines use of a tokenizer (the built-in one or a Hugging Face one)."""

    @property
    def eos_id(self) -> int | None: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a reply (EOS and the model's other end ids)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str, *, bos: bool = False, sep: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str: ...

    def token_id(self, piece: str) -> int: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]: ...


def local_path(uri: str) -> Path:
    """A local directory holding `uri`, through the storage layer: file:///P -> /P;
    pvc://CLAIM/P -> <where this pod mounts CLAIM>/P; s3://BUCKET/PREFIX -> a copy downloaded once
    per host and URI into the cache (`storage.cached_copy`)."""
    if storage.is_object_store(uri):
        try:
            return storage.cached_copy(uri)
        except storage.StorageError as e:  # the user's URI or credentials: the same spec fails again
            raise ModelLoadError(str(e)) from e
    if uri.startswith(storage.LOCAL_SCHEMES):
        return storage.local_path(uri)
    raise ModelLoadError(
        f"{uri}: only builtin://, file://, pvc:// and s3:// models can be loaded by this runtime"
    )


def _builtin(uri: str) -> str | None:
    return uri.removeprefix("builtin://") if uri.startswith("builtin://") else None


def model_dir(uri: str) -> Path:
    """The local directory of a Hugging Face model URI (a built-in one is materialised first)."""
    name = _builtin(uri)
    if name is not None:
        if name not in HF_BUILTINS:
            raise ModelLoadError(f"{uri}: not a Hugging Face model (built-in ones: {sorted(HF_BUILTINS)})")
        return materialise(name)
    return local_path(uri)


def is_hf(uri: str) -> bool:
    name = _builtin(uri)
    return name is None or name in HF_BUILTINS


def load_tokenizer(uri: str, *, trust_remote_code: bool = False) -> Tokenizer:
    if not is_hf(uri):
        return CharTokenizer()
    return HFTokenizer(model_dir(uri), uri, trust_remote_code=trust_remote_code)


def load_model(
    uri: str, seed: int = 0, dtype: str = "auto", *, trust_remote_code: bool = False, cuda: bool = False
) -> torch.nn.Module:
    """The policy's initial weights as a torch module, in `dtype` (auto: bfloat16 when `cuda`, else
    float32). The seed initialises the plain-torch built-in models; a directory has its weights."""
    from polyrl_runtime.models.tiny import TINY_SIZES, build_tiny

    torch_dtype = resolve_dtype(dtype, cuda=cuda)
    name = _builtin(uri)
    if name is not None and name not in HF_BUILTINS:
        if name not in TINY_SIZES:
            known = sorted([*TINY_SIZES, *HF_BUILTINS])
            raise ModelLoadError(f"unknown built-in model builtin://{name}; known: {known}")
        vocab = 64
        assert CharTokenizer().vocab_size <= vocab
        model: torch.nn.Module = build_tiny(name, vocab, seed)
        return model.to(torch_dtype)
    return load_hf_model(model_dir(uri), uri, torch_dtype, trust_remote_code=trust_remote_code)


def context_limit(model: torch.nn.Module) -> int:
    """The most tokens (prompt and reply) the model can attend over."""
    from polyrl_runtime.models.tiny import TinyConfig

    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, TinyConfig):
        return cfg.max_len
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) else 1 << 30
