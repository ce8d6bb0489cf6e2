"""Hugging Face causal LMs and tokenizers from a model directory.

A directory is loaded exactly as a downloaded checkpoint is: `AutoModelForCausalLM` with the dtype
the RLJob asks for and SDPA attention, `AutoTokenizer` beside it; `trust_remote_code` only when the
job opts in. The tokenizer adapter gives workflows and engines one small interface whatever the
model: EOS and pad ids (from the tokenizer and `generation_config.json`, which may list several end
ids, as Qwen's and Llama 3's do), the chat template, and token ids of text pieces.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)

# torch is imported where a model is built, never at import: the driver and workflow workers use
# this module's errors and tokenizers only, and torch costs each of those processes about 2 s of CPU.
DTYPES = ("float32", "bfloat16", "float16")


class ModelLoadError(ValueError):
    """A model or tokenizer directory cannot be loaded; the message names the URI and the cause."""


def resolve_dtype(dtype: str, *, cuda: bool) -> torch.dtype:
    """`model.dtype` as a torch dtype: auto is bfloat16 on a GPU and float32 on a CPU."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if cuda else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"model.dtype {dtype!r}: expected auto, {', '.join(DTYPES)}")
    dtype_: torch.dtype = getattr(torch, dtype)
    return dtype_


def check_model_dir(path: Path, uri: str) -> None:
    if not path.is_dir():
        raise ModelLoadError(f"{uri}: model directory {path} does not exist (model.uri)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{uri}: {path} is not a Hugging Face model directory (no config.json); "
            "save one with save_pretrained"
        )


def _quiet_transformers() -> Any:
    transformers: Any = importlib.import_module("transformers")

    transformers.utils.logging.disable_progress_bar()  # progress bars are noise in pod logs
    return transformers


def load_hf_model(path: Path, uri: str, dtype: torch.dtype, *, trust_remote_code: bool) -> torch.nn.Module:
    """SDPA attention where the architecture has it (every current decoder in transformers), the
    model's own default otherwise."""
    check_model_dir(path, uri)
    transformers = _quiet_transformers()

    def load(**extra: Any) -> torch.nn.Module:
        model: torch.nn.Module = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, trust_remote_code=trust_remote_code, **extra
        )
        return model

    try:
        try:
            model = load(attn_implementation="sdpa")
        except ValueError as e:
            if "scaled_dot_product_attention" not in str(e):
                raise
            log.info("model.no_sdpa", uri=uri, reason="the architecture has no SDPA attention")
            model = load()
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise ModelLoadError(
                f"{uri}: the model's code is not part of transformers; set model.trustRemoteCode: true "
                "to run the code shipped in the model directory"
            ) from e
        raise ModelLoadError(f"{uri}: cannot load the model: {e}") from e
    except (OSError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"{uri}: cannot load the model: {e}") from e
    log.info("model.loaded", uri=uri, dtype=str(dtype).removeprefix("torch."), cls=type(model).__name__)
    return model


def _end_ids(path: Path, tok: Any) -> tuple[int, ...]:
    """Every id that ends a reply: the tokenizer's EOS plus `generation_config.json`'s eos ids."""
    ids: list[int] = []
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos] if eos is not None else []:
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


class HFTokenizer:
    """A Hugging Face tokenizer behind the runtime's small tokenizer interface."""

    def __init__(self, path: Path, uri: str, *, trust_remote_code: bool = False) -> None:
        check_model_dir(path, uri)
        transformers = _quiet_transformers()
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(
                str(path), trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{uri}: cannot load the tokenizer: {e}") from e
        self.uri = uri
        self.stop_ids: tuple[int, ...] = _end_ids(path, self._tok)
        self.eos_id: int | None = self.stop_ids[0] if self.stop_ids else None
        pad = self._tok.pad_token_id
        self.pad_id: int = int(pad) if pad is not None else (self.eos_id if self.eos_id is not None else 0)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, *, bos: bool = False, sep: bool = False) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=bos)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special))

    def token_id(self, piece: str) -> int:
        ids = self._tok.encode(piece, add_special_tokens=False)
        if len(ids) != 1:
            raise KeyError(f"{piece!r} is not one token of {self.uri} (it encodes to {len(ids)} ids)")
        return int(ids[0])

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of `messages` rendered by the model's chat template."""
        if not self.has_chat_template:
            raise ModelLoadError(
                f"{self.uri}: the tokenizer has no chat template (tokenizer_config.json or "
                "chat_template.jinja); give one, or prompt the agent with plain text"
            )
        out = self._tok.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        return [int(i) for i in out]
