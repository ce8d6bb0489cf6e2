"""GGUF model files as Hugging Face checkpoints: converted once, into a cache keyed by the file's content.

A GGUF file (llama.cpp's format: weights, often quantised, plus the config, tokenizer and chat
template) is a model format like a Hugging Face directory. transformers reads it (`gguf_file=`, with
the `gguf` package) by dequantising every tensor and converting the tokenizer, which takes tens of
seconds, and the model it returns cannot be saved. So a `.gguf` model URI is converted once per host
into an ordinary checkpoint directory (float32 safetensors, config, generation config, tokenizer and
chat template) under `<cache>/models/gguf-<sha256 of the file>-c<CONVERSION>`, and every consumer (the
torch engine, vLLM, the trainer, LoRA, exports) loads that directory like any other. `model.dtype`
applies when the directory is loaded, after dequantisation.

Invariants: a cache directory is complete whenever it exists (written beside it, then renamed); one
process converts while others on the host wait on a file lock (and log what they wait for); a file is
checked before transformers sees it, so a missing, truncated or foreign file, an architecture
transformers cannot build from GGUF or a quantisation type it cannot dequantise is a ModelLoadError
naming the URI and the cause.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from polyrl_runtime import storage
from polyrl_runtime.models.hf import ModelLoadError
from polyrl_runtime.waiting import lock_deadline_s, locked

log = structlog.get_logger(__name__)

SUFFIX = ".gguf"
MAGIC = b"GGUF"
# Bumped whenever the conversion's output changes, so a directory written by another conversion is
# never reused.
CONVERSION = 1
GGUF_EXTRA = "gguf"
"""The runtime's extra that installs the `gguf` package (`pip install 'polyrl-runtime[gguf]'`)."""
# GGUF architecture names that transformers lists under another name.
_ARCH_ALIASES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
# Plain (unquantised) tensor types every loader reads as they are.
_PLAIN_TYPES = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})


def is_gguf(uri: str) -> bool:
    """Whether a model URI names a GGUF file (by its suffix, as llama.cpp and transformers do)."""
    return uri.lower().rstrip("/").endswith(SUFFIX)


def _gguf_module(uri: str) -> Any:
    try:
        return importlib.import_module("gguf")
    except ImportError as e:
        raise ModelLoadError(
            f"{uri}: reading a GGUF model needs the `gguf` package: "
            f"pip install 'polyrl-runtime[{GGUF_EXTRA}]'"
        ) from e


@dataclass(frozen=True)
class GGUFInfo:
    """What the checks read from a GGUF file's header."""

    architecture: str
    tensors: int
    types: dict[str, int]
    """Tensor type name -> how many tensors have it."""


def supported_architectures() -> list[str]:
    """The GGUF architectures the installed transformers builds a model from."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def dequantisable_types(gguf: Any) -> frozenset[str]:
    """Tensor types the installed `gguf` package can dequantise (plus the plain ones)."""
    return _PLAIN_TYPES | frozenset(t.name for t in gguf.quants._type_traits)


def inspect(path: Path, uri: str) -> GGUFInfo:
    """The file's architecture and tensor types, after checking that it is a whole GGUF file that
    transformers can convert; a ModelLoadError naming `uri` otherwise."""
    if not path.is_file():
        what = "is a directory, not a GGUF file" if path.is_dir() else "does not exist"
        raise ModelLoadError(f"{uri}: model.uri: the GGUF file {path} {what}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise ModelLoadError(
            f"{uri}: model.uri: {path} is not a GGUF file (it starts with {magic!r}, not {MAGIC!r}); "
            "name a .gguf file written by llama.cpp or the gguf package, or a Hugging Face directory"
        )
    gguf = _gguf_module(uri)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, IndexError, ... for a damaged header
        raise ModelLoadError(f"{uri}: model.uri: {path} is a damaged or truncated GGUF file: {e}") from e
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(
            f"{uri}: model.uri: {path} is a damaged or truncated GGUF file: its tensors need {end} "
            f"bytes, the file has {size}"
        )
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError(f"{uri}: model.uri: {path} names no architecture (general.architecture)")
    arch = bytes(field.parts[field.data[0]]).decode()
    known = supported_architectures()
    if _ARCH_ALIASES.get(arch, arch) not in known:
        raise ModelLoadError(
            f"{uri}: model.uri: {path} holds a {arch!r} model, which transformers cannot build from GGUF "
            f"(it can: {', '.join(known)}); convert the model to a Hugging Face directory another way"
        )
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    bad = sorted(set(types) - dequantisable_types(gguf))
    if bad:
        raise ModelLoadError(
            f"{uri}: model.uri: {path} has tensors quantised as {', '.join(bad)}, which the gguf package "
            f"cannot dequantise (it can: {', '.join(sorted(dequantisable_types(gguf)))}); "
            "use a file quantised another way"
        )
    return GGUFInfo(architecture=arch, tensors=len(reader.tensors), types=types)


def convert(path: Path, out: Path, uri: str, *, final: Path | None = None) -> Path:
    """Write the Hugging Face checkpoint of the GGUF file `path` into `out` (created): float32
    safetensors, config (without the GGUF quantisation entry), generation config, tokenizer and
    chat template. Logs each stage and the time it took (naming `final`, where `out` is renamed to
    once written)."""
    start = time.monotonic()
    info = inspect(path, uri)
    log.info(
        "model.gguf.converting",
        uri=uri,
        architecture=info.architecture,
        tensors=info.tensors,
        types=info.types,
        stage="config and tokenizer",
    )
    transformers: Any = importlib.import_module("transformers")
    import torch

    transformers.utils.logging.disable_progress_bar()
    folder, name = str(path.parent), path.name
    try:
        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        log.info("model.gguf.converting", uri=uri, stage="dequantising the weights")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        )
    except (ValueError, KeyError, OSError, RuntimeError, NotImplementedError) as e:
        raise ModelLoadError(f"{uri}: model.uri: transformers cannot convert {path}: {e}") from e
    # A model loaded from GGUF refuses save_pretrained ("quantized with gguf"): the checkpoint is a
    # fresh model of the same config holding the dequantised tensors.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    log.info("model.gguf.converting", uri=uri, stage="saving")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    params = sum(p.numel() for p in model.parameters())
    log.info(
        "model.gguf.converted",
        uri=uri,
        path=str(final or out),
        parameters=params,
        cls=type(model).__name__,
        seconds=round(time.monotonic() - start, 1),
    )
    return out


def content_hash(path: Path) -> str:
    """sha256 of the file, memoised per (path, size, mtime) so that each process reading a cached
    conversion does not hash the whole file again."""
    st = path.stat()
    memo_dir = storage.cache_root() / "models" / "content-hashes"
    key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = memo_dir / key
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    memo_dir.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(digest)
    tmp.replace(memo)
    return digest


def converted_dir(path: Path, uri: str) -> Path:
    """The cached Hugging Face checkpoint of the GGUF file `path`, converted on first use."""
    if not path.is_file():
        inspect(path, uri)  # raises the missing-file error
    root = storage.cache_root() / "models"
    final = root / f"gguf-{content_hash(path)[:32]}-c{CONVERSION}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    lock_path = root / f".{final.name}.lock"
    with (
        open(lock_path, "a+b") as lock,
        locked(lock, lock_path, what=f"conversion of the GGUF model {uri}", deadline_s=lock_deadline_s()),
    ):
        if (final / "config.json").is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            convert(path, tmp, uri, final=final)
            (tmp / "polyrl-source.json").write_text(json.dumps({"uri": uri, "file": path.name}))
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
