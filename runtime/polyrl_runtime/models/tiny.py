"""A small causal transformer in plain torch: the `builtin://tiny` model of the CPU examples and tests.

Pre-norm blocks, learned positions, a separate output head. Sequences may be left-padded: the
attention mask hides padding and positions count real tokens only, so a batch of prompts of different
lengths gives each the same logits as it would get alone (the engine relies on that for batching).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

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

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        a = nnf.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.ff2(nnf.gelu(self.ff1(self.ln2(x))))
        return out


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

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, time, vocab] for `input_ids` [batch, time] (1 = real token in the mask)."""
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
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def build_tiny(name: str, vocab_size: int, seed: int) -> TinyCausalLM:
    """`builtin://NAME`: tiny (~0.25M parameters) or small (~1M)."""
    sizes = {
        "tiny": TinyConfig(vocab_size=vocab_size),
        "small": TinyConfig(vocab_size=vocab_size, d_model=192, n_layers=3, n_heads=6, d_ff=512),
    }
    if name not in sizes:
        raise ValueError(f"unknown built-in model builtin://{name}; known: {sorted(sizes)}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return TinyCausalLM(sizes[name])
