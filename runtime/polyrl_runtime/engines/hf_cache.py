"""Cached decoding of a Hugging Face causal LM for a batch whose rows come and go.

The running batch's keys/values live in a transformers `DynamicCache` whose rows are left-padded to
one width: row i's real tokens are the last `positions[i]` cached columns, `mask` marks them, and
each decoding step appends one column to every row (the model gets the 2-D attention mask and the
per-row position ids, as Hugging Face's own batched `generate` does with left padding). So a token
costs one single-token forward step whatever its position: no sequence is recomputed.

Rows join by `concat` (a batch prefilled separately, both padded on the left to the wider width)
and leave by `select`, which also drops the leading columns no remaining row uses; each copies the
cache once, between two steps. Between joins and leaves a step writes its column in place into
buffers with spare columns (`_GrowingLayer`), where transformers' `DynamicLayer` would copy the
whole cache at every step. Every layer keeps full keys/values, also for models with sliding-window
layers (their masks come from the model config, so the result is the same; only the memory is not
bounded by the window).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for layer in cache.layers:
        # Only layers that keep every column: others (a window that drops old columns, linear-
        # attention states) are not position-aligned, so rows cannot be padded or joined.
        if not isinstance(layer, DynamicLayer) or type(layer) not in (DynamicLayer, _GrowingLayer):
            raise TypeError(f"the torch engine caches attention layers only, not {type(layer).__name__}")
        if layer.keys is None or layer.values is None or not layer.is_initialized:
            raise ValueError("a cache layer was never filled")
        out.append((layer.keys, layer.values))
    return out


class _GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers' __init_subclass__
    """A `DynamicLayer` whose keys/values are views of buffers with spare columns: a decoding step
    writes its column in place (amortised O(1) per token) where `DynamicLayer` copies the whole
    cache (`torch.cat`) at every step."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.lazy_initialization(keys, values)
        self._kbuf, self._vbuf, self._len = keys, values, int(keys.shape[-2])
        self.keys, self.values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._len + int(key_states.shape[-2])
        if end > self._kbuf.shape[-2]:
            self._kbuf = _grown(self._kbuf, self._len, end)
            self._vbuf = _grown(self._vbuf, self._len, end)
        self._kbuf[:, :, self._len : end] = key_states
        self._vbuf[:, :, self._len : end] = value_states
        self._len = end
        self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]
        return self.keys, self.values


def _grown(buf: torch.Tensor, used: int, need: int) -> torch.Tensor:
    rows, heads, cap, dim = buf.shape
    out = buf.new_empty(rows, heads, max(2 * cap, need, 16), dim)
    out[:, :, :used] = buf[:, :, :used]
    return out


def _cache_of(kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [_GrowingLayer(k, v) for k, v in kv]
    return cache


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, heads, w, dim] -> [rows, heads, width, dim], zeros in front (masked out)."""
    extra = width - t.shape[-2]
    if extra == 0:
        return t
    return torch.cat([t.new_zeros(*t.shape[:-2], extra, t.shape[-1]), t], dim=-2)


@dataclass
class BatchCache:
    """Keys/values of `rows` sequences, left-padded to `width` columns (`cache` is None when the
    width is 0: no row has a cached token yet)."""

    cache: DynamicCache | None
    mask: torch.Tensor  # [rows, width] long: 1 where a real cached token sits
    positions: torch.Tensor  # [rows] long: cached tokens per row = the next token's position id
    # Whether some row has padding. Set when rows join or leave (a step appends a real column to
    # every row); without padding the model gets no mask, which spares its mask construction.
    padded: bool = field(init=False)

    def __post_init__(self) -> None:
        self.padded = bool((self.mask == 0).any())

    @classmethod
    def empty(cls, device: torch.device) -> BatchCache:
        z = torch.zeros(0, 0, dtype=torch.long, device=device)
        return cls(None, z, torch.zeros(0, dtype=torch.long, device=device))

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def _kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return _layers(self.cache) if self.cache is not None else []

    def select(self, rows: Sequence[int]) -> BatchCache:
        """These rows, in this order; leading columns that no kept row uses are dropped."""
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.mask.device)
        mask = self.mask[idx]
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else self.width
        kv = [(k[idx, :, start:], v[idx, :, start:]) for k, v in self._kv()]
        cache = _cache_of(kv) if kv and start < self.width else None
        return BatchCache(cache, mask[:, start:], self.positions[idx])

    def concat(self, other: BatchCache) -> BatchCache:
        """This batch's rows followed by `other`'s."""
        if not other.rows:
            return self
        if not self.rows:
            return other
        width = max(self.width, other.width)
        mask = torch.cat([_pad_mask(self.mask, width), _pad_mask(other.mask, width)])
        positions = torch.cat([self.positions, other.positions])
        mine, theirs = self._kv(), other._kv()
        if not mine and not theirs:
            return BatchCache(None, mask, positions)
        if not mine:  # width 0 so far: zeros of the other batch's layout
            mine = [(_zeros_like(k, self.rows), _zeros_like(v, self.rows)) for k, v in theirs]
        if not theirs:
            theirs = [(_zeros_like(k, other.rows), _zeros_like(v, other.rows)) for k, v in mine]
        kv = [
            (
                torch.cat([_pad_left(k0, width), _pad_left(k1, width)]),
                torch.cat([_pad_left(v0, width), _pad_left(v1, width)]),
            )
            for (k0, v0), (k1, v1) in zip(mine, theirs, strict=True)
        ]
        return BatchCache(_cache_of(kv), mask, positions)

    def decode(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([rows] ids); returns [rows, vocab] next-token logits. The new
        tokens' keys/values join the cache."""
        ones = torch.ones(self.rows, 1, dtype=torch.long, device=self.mask.device)
        mask = torch.cat([self.mask, ones], dim=1)
        cache = self.cache if self.cache is not None else DynamicCache()
        out = model(
            input_ids=ids[:, None],
            attention_mask=mask if self.padded else None,
            position_ids=self.positions[:, None],
            cache=cache,
            use_cache=True,
        )
        self.cache, self.mask, self.positions = cache, mask, self.positions + 1
        return _logits(out)[:, -1]


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros(mask.shape[0], width - mask.shape[1]), mask], dim=1)


def _zeros_like(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.new_zeros(rows, t.shape[1], 0, t.shape[3])


def _logits(out: Any) -> torch.Tensor:
    logits = out.logits
    assert isinstance(logits, torch.Tensor)
    return logits


def prefill(model: torch.nn.Module, seqs: Sequence[Sequence[int]], pad_id: int = 0) -> BatchCache:
    """Cache every token of each sequence (left-padded into one forward pass; empty sequences get
    a row with no cached token)."""
    device = next(model.parameters()).device
    width = max((len(s) for s in seqs), default=0)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
    mask, ids = mask.to(device), ids.to(device)
    positions = mask.sum(dim=1)
    if width == 0:
        return BatchCache(None, mask, positions)
    cache = DynamicCache()
    model(
        input_ids=ids,
        attention_mask=mask if any(len(s) < width for s in seqs) else None,
        position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,  # the logits are not used: skip the [rows, width, vocab] projection
    )
    return BatchCache(_cache_of(_layers(cache)), mask, positions)
