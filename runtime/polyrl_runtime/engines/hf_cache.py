"""Cached decoding of a Hugging Face causal LM for a batch whose rows come and go.

The running batch's keys/values live in a transformers `DynamicCache` whose rows are left-padded to
one width: row i's real tokens are the last `width - pad[i]` cached columns, and each decoding step
appends one column to every row. The model gets the per-row position ids (`width - pad`) and, only
while some row has padding, the 2-D attention mask built from `pad`, as Hugging Face's own batched
`generate` does with left padding. So a token costs one single-token forward step whatever its
position: no sequence is recomputed.

Rows join by `prefill` (the whole sequence in one forward pass, which also gives each row's next-token
logits) and `concat` (both batches padded on the left to the wider width), and leave by `select`,
which also drops the leading columns no remaining row uses; each copies the cache once, between two
steps. Between joins and leaves a step writes its column in place into buffers with spare columns
(`hf_layers.GrowingLayer`), where transformers' `DynamicLayer` would copy the whole cache at every step, and
touches no other per-row state: the padding is constant while the rows are. Every layer keeps full
keys/values, also for models with sliding-window layers (their masks come from the model config, so
the result is the same; only the memory is not bounded by the window).

transformers is imported when a batch is first cached, not with this module: an engine of a built-in
plain-torch model never needs it (about 1 s of CPU in each engine process).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from polyrl_runtime.device_memory import storage_bytes, unique_storages

if TYPE_CHECKING:
    from transformers import DynamicCache


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from transformers.cache_utils import DynamicLayer

    from polyrl_runtime.engines.hf_layers import GrowingLayer

    out = []
    for layer in cache.layers:
        # Only layers that keep every column: others (a window that drops old columns, linear-
        # attention states) are not position-aligned, so rows cannot be padded or joined.
        if not isinstance(layer, DynamicLayer) or type(layer) not in (DynamicLayer, GrowingLayer):
            raise TypeError(f"the torch engine caches attention layers only, not {type(layer).__name__}")
        if layer.keys is None or layer.values is None or not layer.is_initialized:
            raise ValueError("a cache layer was never filled")
        out.append((layer.keys, layer.values))
    return out


def _cache_of(kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    from transformers import DynamicCache

    from polyrl_runtime.engines.hf_layers import GrowingLayer

    cache = DynamicCache()
    cache.layers = [GrowingLayer(k, v) for k, v in kv]
    return cache


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, heads, w, dim] -> [rows, heads, width, dim], zeros in front (masked out)."""
    extra = width - t.shape[-2]
    if extra == 0:
        return t
    return torch.cat([t.new_zeros(*t.shape[:-2], extra, t.shape[-1]), t], dim=-2)


@dataclass
class BatchCache:
    """Keys/values of `rows` sequences, left-padded to `width` columns (`cache` is None when there
    is no row)."""

    cache: DynamicCache | None
    pad: torch.Tensor  # [rows, 1] long: leading padding columns of each row (masked out)
    width: int
    # Whether some row has padding: fixed while the rows are (a step appends a real column to every
    # row). Without padding the model gets no mask, which spares its mask construction.
    padded: bool = field(init=False)

    def __post_init__(self) -> None:
        self.padded = bool((self.pad > 0).any())

    @classmethod
    def empty(cls, device: torch.device) -> BatchCache:
        return cls(None, torch.zeros(0, 1, dtype=torch.long, device=device), 0)

    @property
    def rows(self) -> int:
        return int(self.pad.shape[0])

    @property
    def nbytes(self) -> int:
        """Device memory its keys and values hold, spare columns included (what freeing it releases)."""
        tensors = [t for kv in self._kv() for t in kv]
        return storage_bytes(unique_storages(tensors)) + self.pad.nbytes

    def positions(self) -> torch.Tensor:
        """[rows, 1] long: each row's cached tokens, which is its next token's position id."""
        return self.width - self.pad

    def mask(self, width: int) -> torch.Tensor:
        """[rows, width] bool: True where a real token sits (the 2-D attention mask)."""
        return torch.arange(width, device=self.pad.device) >= self.pad

    def _kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return _layers(self.cache) if self.cache is not None else []

    def select(self, rows: Sequence[int]) -> BatchCache:
        """These rows, in this order; leading columns that no kept row uses are dropped."""
        if not rows:
            return BatchCache.empty(self.pad.device)
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.pad.device)
        pad = self.pad[idx]
        start = int(pad.min())
        kv = [(k[idx, :, start:], v[idx, :, start:]) for k, v in self._kv()]
        return BatchCache(_cache_of(kv), pad - start, self.width - start)

    def concat(self, other: BatchCache) -> BatchCache:
        """This batch's rows followed by `other`'s."""
        if not other.rows:
            return self
        if not self.rows:
            return other
        width = max(self.width, other.width)
        pad = torch.cat([self.pad + (width - self.width), other.pad + (width - other.width)])
        kv = [
            (
                torch.cat([_pad_left(k0, width), _pad_left(k1, width)]),
                torch.cat([_pad_left(v0, width), _pad_left(v1, width)]),
            )
            for (k0, v0), (k1, v1) in zip(self._kv(), other._kv(), strict=True)
        ]
        return BatchCache(_cache_of(kv), pad, width)

    def decode(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([rows] ids); returns [rows, vocab] next-token logits. The new
        tokens' keys/values join the cache."""
        if self.cache is None:
            raise ValueError("decoding needs cached rows: prefill them first")
        width = self.width + 1
        out = model(
            input_ids=ids[:, None],
            attention_mask=self.mask(width) if self.padded else None,
            position_ids=self.positions(),
            use_cache=True,
            **{cache_argument(model): self.cache},
        )
        self.width = width
        return _logits(out)[:, -1]


_CACHE_ARGUMENT: dict[type[torch.nn.Module], str] = {}


def cache_argument(model: torch.nn.Module) -> str:
    cls = type(model)
    if cls not in _CACHE_ARGUMENT:
        _CACHE_ARGUMENT[cls] = _cache_argument(cls)
    return _CACHE_ARGUMENT[cls]


def _cache_argument(cls: type[torch.nn.Module]) -> str:
    """The name under which the model's `forward` takes its key/value cache: `cache` in recent
    transformers releases, `past_key_values` before. Passing the wrong one is silently swallowed by
    the model's `**kwargs`, and every decoding step would then see its one new token only."""
    params = inspect.signature(cls.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{cls.__name__}.forward takes no key/value cache (neither cache nor past_key_values)")


def _logits(out: Any) -> torch.Tensor:
    logits = out.logits
    assert isinstance(logits, torch.Tensor)
    return logits


def prefill(
    model: torch.nn.Module, seqs: Sequence[Sequence[int]], pad_id: int = 0
) -> tuple[BatchCache, torch.Tensor]:
    """Cache every token of each (non-empty) sequence, left-padded into one forward pass; returns
    the cache and each row's next-token logits ([rows, vocab])."""
    from transformers import DynamicCache

    if not seqs or not all(seqs):
        raise ValueError("prefill needs at least one sequence and no empty one")
    device = next(model.parameters()).device
    width = max(len(s) for s in seqs)
    pad = torch.tensor([[width - len(s)] for s in seqs], dtype=torch.long)
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in seqs], dtype=torch.long)
    pad, ids = pad.to(device), ids.to(device)
    mask = torch.arange(width, device=device) >= pad
    padded = bool(mask.logical_not().any())
    cache = DynamicCache()
    out = model(
        input_ids=ids,
        attention_mask=mask if padded else None,
        position_ids=(torch.arange(width, device=device) - pad).clamp(min=0),
        use_cache=True,
        **{cache_argument(model): cache},
        logits_to_keep=1,  # only the last position's logits: no [rows, width, vocab] projection
    )
    return BatchCache(_cache_of(_layers(cache)), pad, width), _logits(out)[:, -1]
