"""The transformers side of `hf_cache`: a cache layer that grows in place. Its own module, imported
on first use, so that importing the engine does not import transformers."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers' __init_subclass__
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
