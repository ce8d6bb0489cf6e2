"""A small causal transformer in plain torch: the `builtin://tiny` model of the CPU examples and tests.

Pre-norm blocks, learned positions, a separate output head. Sequences may be left-padded: the
attention mask hides padding and positions count real tokens only, so a batch of prompts of different
lengths gives each the same logits as it would get alone (the engine relies on that for batching).

Generation uses a KV cache (`KVCache`, `prefill`, `decode`): a sequence's keys and values are computed
once, then each decoding step feeds one token per row, so a token costs the same at any position.
`forward` (what the trainer computes) and the cached path give the same logits up to float rounding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as nnf
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 64
    d_model: int = 96
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_len: int = 128

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class _Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ff1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.ff2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [batch, heads, time, head_dim] of the block's input `x`."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.n_heads, d // self.n_heads)
        return q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)

    def finish(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The block's output from its input `x` and the attention output `a` [batch, heads, time, hd]."""
        b, t, d = x.shape
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.ff2(nnf.gelu(self.ff1(self.ln2(x))))
        return out

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        return self.finish(x, nnf.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask))


class KVCache:
    """Keys and values of up to `rows` sequences for `TinyCausalLM.prefill`/`decode`.

    One row per sequence, its token j at column j: a row's `lengths` entry says how many leading
    columns are real; later columns hold stale values that attention masks out and decoding
    overwrites. Rows are addressed by index, so a caller that keeps its live
    sequences in rows 0..n-1 decodes on views of the buffers, never on gathered copies.
    """

    def __init__(self, cfg: TinyConfig, rows: int, *, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg = cfg
        self.k, self.v, self.lengths = self._alloc(rows, dtype, device)

    def _alloc(
        self, rows: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        cfg = self.cfg
        shape = (rows, cfg.n_heads, cfg.max_len, cfg.d_model // cfg.n_heads)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        return k, v, torch.zeros(rows, dtype=torch.long, device=device)

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    def grow(self, rows: int) -> None:
        """At least `rows` rows, keeping the current ones."""
        if rows <= self.rows:
            return
        old_k, old_v, old_len = self.k, self.v, self.lengths
        self.k, self.v, self.lengths = self._alloc(rows, old_k[0].dtype, old_k[0].device)
        for new, old in zip(self.k + self.v, old_k + old_v, strict=True):
            new[: old.shape[0]] = old
        self.lengths[: old_len.shape[0]] = old_len

    def move(self, src: int, dst: int) -> None:
        """Copy row `src` into row `dst` (to keep the live rows contiguous when one leaves)."""
        n = int(self.lengths[src])
        for buf in self.k + self.v:
            buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst] = n


class TinyCausalLM(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        # Token embeddings dominate the residual stream at init, so different prompts get clearly
        # different hidden states: policy-gradient updates then change the policy per context instead
        # of drifting one shared bias (which collapses a fresh policy to one action for every prompt).
        nn.init.normal_(self.tok.weight, std=1.0)
        nn.init.normal_(self.pos.weight, std=0.1)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def get_output_embeddings(self) -> nn.Linear:
        """The head mapping final hidden states to logits (Hugging Face's name for it)."""
        return self.head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Logits [batch, time, vocab] for `input_ids` [batch, time] (1 = real token in the mask), or with
        `return_hidden` the final hidden states [batch, time, d_model] the head would map to logits."""
        t = input_ids.shape[1]
        if t > self.cfg.max_len:
            raise ValueError(f"sequence of {t} tokens exceeds the model's max_len {self.cfg.max_len}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.bool()
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        # [b, 1, t, t]: attend to earlier real tokens; a padding query attends to itself (no NaN rows).
        allowed = (causal[None] & mask[:, None, :]) | torch.eye(t, dtype=torch.bool, device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x, allowed[:, None])
        hidden: torch.Tensor = self.ln_f(x)
        if return_hidden:
            return hidden
        logits: torch.Tensor = self.head(hidden)
        return logits

    def _layers(self) -> list[_Block]:
        return [b for b in self.blocks if isinstance(b, _Block)]  # typed: ModuleList yields Module

    def new_cache(self, rows: int) -> KVCache:
        p = self.head.weight
        return KVCache(self.cfg, rows, dtype=p.dtype, device=p.device)

    def prefill(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache, rows: torch.Tensor
    ) -> None:
        """Write the keys and values of right-padded sequences `input_ids` [n, time] (row i's first
        `lengths[i]` tokens are real) into cache rows `rows` [n], and set those rows' lengths.

        Right padding needs no mask here: causal attention never lets a real token see the padding
        after it, and the padding's own keys land beyond the row's length, where `decode` ignores them.
        """
        t = input_ids.shape[1]
        if t > self.cfg.max_len:
            raise ValueError(f"sequence of {t} tokens exceeds the model's max_len {self.cfg.max_len}")
        positions = torch.arange(t, device=input_ids.device)
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        x = self.tok(input_ids) + self.pos(positions)[None]
        for layer, block in enumerate(self._layers()):
            q, k, v = block.heads(x)
            cache.k[layer][rows, :, :t] = k
            cache.v[layer][rows, :, :t] = v
            if layer + 1 < len(self.blocks):  # the last block's output feeds no cache
                x = block.finish(x, nnf.scaled_dot_product_attention(q, k, v, attn_mask=causal))
        cache.lengths[rows] = lengths

    def decode(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Next-token logits [n, vocab] after appending one token per row (`input_ids` [n]) to cache
        rows 0..n-1, each at its row's length (its position: the row's real tokens before it)."""
        n = input_ids.shape[0]
        lengths = cache.lengths[:n]
        if n and int(lengths.max()) >= self.cfg.max_len:
            raise ValueError(f"a sequence would exceed the model's max_len {self.cfg.max_len}")
        width = int(lengths.max()) + 1 if n else 1
        rows = torch.arange(n, device=input_ids.device)
        # [n, 1, 1, width]: each row's query sees its own real columns, the new token included.
        allowed = (torch.arange(width, device=input_ids.device)[None] <= lengths[:, None])[:, None, None]
        x = (self.tok(input_ids) + self.pos(lengths))[:, None]
        for layer, block in enumerate(self._layers()):
            q, k, v = block.heads(x)
            kc, vc = cache.k[layer], cache.v[layer]
            kc[rows, :, lengths] = k[:, :, 0]
            vc[rows, :, lengths] = v[:, :, 0]
            a = nnf.scaled_dot_product_attention(q, kc[:n, :, :width], vc[:n, :, :width], attn_mask=allowed)
            x = block.finish(x, a)
        cache.lengths[:n] += 1
        logits: torch.Tensor = self.head(self.ln_f(x))[:, 0]
        return logits


TINY_SIZES = {
    "tiny": TinyConfig(),
    "small": TinyConfig(d_model=192, n_layers=3, n_heads=6, d_ff=512),
}


def build_tiny(name: str, vocab_size: int, seed: int) -> TinyCausalLM:
    """`builtin://NAME`: tiny (~0.25M parameters) or small (~1M)."""
    if name not in TINY_SIZES:
        raise ValueError(f"unknown built-in model builtin://{name}; known: {sorted(TINY_SIZES)}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return TinyCausalLM(replace(TINY_SIZES[name], vocab_size=vocab_size))
