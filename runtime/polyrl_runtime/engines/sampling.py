"""Token sampling for the torch engine: pure functions of next-token logits and each row's
sampling parameters and generator.

A row's behaviour logprob is `constrained_logprobs` of its logits: log-softmax at its temperature
over its allowed ids only. `sample_batch` computes it for a whole batch at once; a seeded row draws
from its own generator, so its tokens do not depend on the other rows of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from polyrl_runtime.engines.api import SamplingParams


class SampledRow(Protocol):
    """What sampling reads of a request: its parameters, its own generator (seeded requests) and
    its allowed-ids bias."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def generator(self) -> torch.Generator | None: ...

    def bias(self, vocab: int) -> torch.Tensor:
        """[vocab]: 0 for the allowed ids (all when unconstrained), -inf elsewhere."""
        ...


def constrained_logprobs(
    logits: torch.Tensor, temperature: float, allowed: torch.Tensor | None
) -> torch.Tensor:
    """Log-softmax of logits/temperature over `allowed` ids only (the behaviour-logprob convention)."""
    scaled = logits / max(temperature, 1e-5)
    if allowed is not None and allowed.numel():
        bias = torch.full_like(scaled, float("-inf"))
        bias[..., allowed] = 0.0
        scaled = scaled + bias
    return torch.log_softmax(scaled.float(), dim=-1)


def sample_batch(
    batch: Sequence[SampledRow], logits: torch.Tensor, rng: torch.Generator
) -> tuple[list[int], list[float]]:
    """One token per row and its behaviour logprob: `constrained_logprobs` of each row, computed
    for the whole batch at once (per-row tensor calls would cost more than a decoding step). Rows
    without a generator of their own draw from `rng`."""
    temps = [max(r.params.temperature, 1e-5) for r in batch]
    one_temp = all(t == temps[0] for t in temps)  # one temperature: no per-row tensor to build
    scaled = logits / temps[0] if one_temp else logits / torch.tensor(temps)[:, None]
    if any(r.params.allowed_ids for r in batch):
        scaled = scaled + torch.stack([r.bias(logits.shape[-1]) for r in batch])
    lp = torch.log_softmax(scaled, dim=-1)
    if all(r.params.temperature == 0 for r in batch):  # all greedy: one max gives both
        top_lp, top = lp.max(dim=-1)  # the first maximal id, as argmax
        return top.tolist(), top_lp.tolist()
    # Plain sampling shares one draw over its rows and greedy rows one argmax. A seeded row (a
    # seed promises the same tokens whatever else is in the batch) draws its uniform number from
    # its own generator, then all seeded rows invert their CDFs at once; top-p rows are sampled
    # one by one.
    tokens = [0] * len(batch)
    greedy = [i for i, r in enumerate(batch) if r.params.temperature == 0]
    full = [i for i, r in enumerate(batch) if r.params.temperature > 0 and r.params.top_p >= 1.0]
    plain = [i for i in full if batch[i].generator is None]
    seeded = [i for i in full if batch[i].generator is not None]
    if greedy:
        for i, tok in zip(greedy, lp[greedy].argmax(dim=-1).tolist(), strict=True):
            tokens[i] = tok
    if plain:
        probs = (lp if len(plain) == len(batch) else lp[plain]).exp()
        drawn = torch.multinomial(probs, 1, generator=rng)[:, 0].tolist()
        for i, tok in zip(plain, drawn, strict=True):
            tokens[i] = tok
    if seeded:
        for i, tok in zip(seeded, inverse_cdf(lp[seeded], [batch[i] for i in seeded]), strict=True):
            tokens[i] = tok
    for i in sorted(set(range(len(batch))) - set(full) - set(greedy)):
        tokens[i] = sample_row(lp[i], batch[i].params, batch[i].generator or rng)
    picked = lp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    return tokens, picked


def inverse_cdf(lp: torch.Tensor, rows: Sequence[SampledRow]) -> list[int]:
    """One token per row of `lp` [n, vocab], each from a uniform number of the row's own
    generator: the first id whose cumulative probability exceeds it (an id of probability 0 is
    never drawn). Each row's result depends on its own logits and generator only."""
    u = torch.cat([torch.rand(1, generator=r.generator) for r in rows])
    cdf = lp.exp().cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    over = drawn >= lp.shape[-1]  # u * total rounded up to the total: the likeliest id instead
    drawn[over] = lp[over].argmax(dim=-1)
    return [int(t) for t in drawn.tolist()]


def sample_row(lp: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One token from one row's logprobs `lp` [vocab]: greedy at temperature 0, else drawn from
    `gen` within the top-p mass."""
    if p.temperature == 0:
        return int(lp.argmax())
    probs = lp.exp()
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
