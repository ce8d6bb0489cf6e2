"""The weights a trainer publishes to its rollout engines: exactly what the inference model loads.

Parameters only (buffers such as rotary `inv_freq` are derived from the config and every engine
computes its own), each once (a tied `lm_head.weight` is the same Parameter as
`model.embed_tokens.weight`, and `named_parameters()` yields it under its first name only), under the
Hugging Face names of the model, whatever the ZeRO stage: wrappers' prefixes (`module.` of DDP or
a DeepSpeed engine, `_orig_mod.` of `torch.compile`) are stripped. A peft model publishes its base
model's names with the adapters merged in (`lora.serving_tensors`), or, when its engines hold the base
themselves (policies sharing a base as LoRA adapters), its adapter's tensors alone
(`adapter_only`): peft's names without its wrapper prefix, which `models/lora_layout.py` lays out
on the engine side.

Under ZeRO-3 every parameter is partitioned across the ranks. The publishing rank gathers them a
bucket at a time (a group of parameters of at most `bucket_bytes`, one collective per bucket) and
copies each gathered tensor out before the next bucket is gathered, so it holds one copy of the model
plus one bucket, never two copies. The other ranks take part in the same gathers in the same order
(`keep=False`) without copying anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from polyrl_runtime.trainers.lora import Gather, is_peft, no_gather, serving_tensors

# Parameters gathered per collective under ZeRO-3: large enough that a 0.5B model publishes in a few
# dozen gathers, small enough that the transient gathered bucket is negligible beside the copy.
PUBLISH_BUCKET_BYTES = 256 << 20

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def hf_name(name: str) -> str:
    """`name` without the prefixes that wrappers (DDP, a DeepSpeed engine, torch.compile) add."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    return name


def _full_bytes(p: torch.nn.Parameter) -> int:
    # A ZeRO-3 partitioned parameter holds an empty placeholder; its full size is `ds_numel`.
    numel = int(getattr(p, "ds_numel", p.numel()))
    return numel * p.element_size()


def buckets(
    params: list[tuple[str, torch.nn.Parameter]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive groups of at most `bucket_bytes` (a larger parameter forms a group of its own)."""
    group: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for name, p in params:
        b = _full_bytes(p)
        if group and size + b > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, p))
        size += b
    if group:
        yield group


@torch.no_grad()
def published_tensors(
    module: torch.nn.Module,
    gather: Gather | None = None,
    *,
    keep: bool = True,
    bucket_bytes: int = PUBLISH_BUCKET_BYTES,
    adapter_only: bool = False,
    adapter: str | None = None,
) -> dict[str, torch.Tensor]:
    """{Hugging Face name: tensor} of every parameter the served model has (`adapter_only`: of the
    adapter named `adapter`, else of the active one).

    Without `gather` (ZeRO 0-2: every rank holds full parameters) the tensors are the live ones:
    read them before the next optimizer step. With it (ZeRO-3) each is a copy taken under its bucket's
    gather; with `keep=False` a rank joins the gathers and returns nothing."""
    if adapter_only:
        return adapter_tensors(module, gather, keep=keep, adapter=adapter)
    if is_peft(module):
        merged = serving_tensors(module, gather)
        return {hf_name(n): t for n, t in merged} if keep else _drain(merged)
    named = list(module.named_parameters())
    if gather is None:
        return {hf_name(n): p.detach() for n, p in named} if keep else {}
    out: dict[str, torch.Tensor] = {}
    for group in buckets(named, bucket_bytes):
        with gather([p for _, p in group]):
            if keep:
                out.update((hf_name(n), p.detach().clone()) for n, p in group)
    return out


def _drain(items: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    for _ in items:  # the gathers happen as the iterator advances
        pass
    return {}


PEFT_PREFIX = "base_model.model."


def adapter_tensors(
    module: torch.nn.Module, gather: Gather | None = None, *, keep: bool = True, adapter: str | None = None
) -> dict[str, torch.Tensor]:
    """{name: tensor} of the peft model's adapter named `adapter` (default: the active one), A and B of each adapted layer, under peft's
    names without `base_model.model.` (`model.layers.0.self_attn.q_proj.lora_A.weight`). Copies, taken
    under one gather of the adapter's parameters (ZeRO-3); with `keep=False` a rank joins the gather
    and returns nothing."""
    if not is_peft(module):
        raise TypeError("adapter_only publishing needs a peft model (algorithm.lora set)")
    peft_model: Any = module
    adapter = adapter or peft_model.active_adapter
    named = [(hf_name(n), p) for n, p in module.named_parameters() if ".lora_" in n and f".{adapter}." in n]
    # peft keeps the adapters of a float16 or bfloat16 base in float32 (for the optimizer); the engines
    # hold them in the base's dtype, which their manifest check requires.
    served = next((p.dtype for n, p in module.named_parameters() if ".lora_" not in n), None)
    with (gather or no_gather)([p for _, p in named]):
        if not keep:
            return {}
        return {
            n.removeprefix(PEFT_PREFIX).replace(f".{adapter}.", "."): p.detach().to(served, copy=True)
            for n, p in named
        }
