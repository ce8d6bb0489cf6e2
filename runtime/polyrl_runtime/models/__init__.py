"""Models and tokenizers by URI: `builtin://NAME` (no download) or a Hugging Face directory."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

import torch

from polyrl_runtime.models.tiny import KVCache, TinyCausalLM, TinyConfig, build_tiny
from polyrl_runtime.models.tokenizer import CharTokenizer

__all__ = [
    "CharTokenizer",
    "KVCache",
    "TinyCausalLM",
    "TinyConfig",
    "Tokenizer",
    "build_tiny",
    "load_model",
    "load_tokenizer",
    "local_path",
]


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, bos: bool = False, sep: bool = False) -> list[int]: ...

    def decode(self, ids: Any, *, skip_special: bool = True) -> str: ...

    def token_id(self, piece: str) -> int: ...


def local_path(uri: str) -> Path:
    """file:///P -> /P; pvc://CLAIM/P -> <where this pod mounts CLAIM>/P.

    The operator mounts each claim a pod needs and names the mount points in `POLYRL_PVC_MOUNTS`
    (JSON, claim -> path; /mnt/polyrl/pvc/CLAIM when unset, as in docs/runtime-contract.md)."""
    if uri.startswith("file://"):
        return Path(uri.removeprefix("file://"))
    if uri.startswith("pvc://"):
        claim, _, rest = uri.removeprefix("pvc://").partition("/")
        mounts = json.loads(os.environ.get("POLYRL_PVC_MOUNTS") or "{}")
        return Path(mounts.get(claim, f"/mnt/polyrl/pvc/{claim}")) / rest
    raise ValueError(f"{uri}: only builtin://, file:// and pvc:// models can be loaded by this runtime")


class _HFTokenizer:
    """Adapter giving a Hugging Face tokenizer the built-in tokenizer's small interface."""

    def __init__(self, path: Path) -> None:
        transformers: Any = importlib.import_module("transformers")  # only in GPU images
        self._tok = transformers.AutoTokenizer.from_pretrained(str(path))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str, *, bos: bool = False, sep: bool = False) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=bos)
        return ids

    def decode(self, ids: Any, *, skip_special: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special))

    def token_id(self, piece: str) -> int:
        ids = self._tok.encode(piece, add_special_tokens=False)
        if len(ids) != 1:
            raise KeyError(f"{piece!r} is not one token")
        return int(ids[0])


def load_tokenizer(uri: str) -> Tokenizer:
    if uri.startswith("builtin://"):
        return CharTokenizer()
    path = local_path(uri)
    try:
        return _HFTokenizer(path)
    except ImportError as e:
        raise ValueError(f"{uri}: a Hugging Face tokenizer needs `transformers` (the gpu extra)") from e


def load_model(uri: str, seed: int = 0, dtype: str = "auto") -> torch.nn.Module:
    """The policy's initial weights as a torch module (float32 on CPU unless `dtype` says otherwise)."""
    if uri.startswith("builtin://"):
        vocab = 64
        assert CharTokenizer().vocab_size <= vocab
        model: torch.nn.Module = build_tiny(uri.removeprefix("builtin://"), vocab, seed)
    else:
        path = local_path(uri)
        try:
            transformers: Any = importlib.import_module("transformers")  # only in GPU images
        except ImportError as e:
            raise ValueError(
                f"{uri}: loading a Hugging Face model needs `transformers` (the gpu extra)"
            ) from e
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    if dtype not in ("auto", "float32"):
        model = model.to(getattr(torch, dtype))
    return model
