"""Token log-probabilities and the clipped policy-gradient loss with truncated importance sampling.

Decoupled PPO (AReaL): three policies per token: the behaviour policy mu that generated it (its
logprob was recorded by the engine, possibly several versions old), the proximal policy pi_prox (the
trainer's weights when the step began) and the policy being optimised pi_theta. The loss is

    w * -min(r * A, clip(r, 1 - eps, 1 + eps) * A),   r = pi_theta / pi_prox,   w = min(pi_prox / mu, cap)

so the PPO trust region is taken around the current weights while w corrects for the staleness of
the data, truncated at `is_cap` (truncated IS) to bound variance. An optional KL penalty to the
reference (initial) policy uses the k3 estimator exp(ref - logp) - (ref - logp) - 1, and an optional
entropy bonus (the entropy of each token's distribution over its allowed ids) keeps a policy exploring:
in games where agents must agree on a convention, a policy that commits early can settle on a poor one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from polyrl_runtime.engines.torch_engine import model_logits


@dataclass(frozen=True)
class LossConfig:
    clip_eps: float = 0.2
    is_cap: float = 2.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0


@dataclass(frozen=True)
class LossStats:
    tokens: int
    clip_frac: float
    is_weight_mean: float
    is_truncated_frac: float
    kl: float
    entropy: float


@dataclass(frozen=True)
class TokenBatch:
    """Padded model inputs for a list of (prompt, response, allowed) rows, plus where responses sit."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, R] response token ids (0 where padded)
    response_mask: torch.Tensor  # [B, R] 1 for real response tokens
    gather_index: torch.Tensor  # [B, R] position of the logits that predict each response token
    allowed: list[npt.NDArray[np.int32]]

    @classmethod
    def build(
        cls,
        prompts: Sequence[npt.NDArray[np.int32]],
        responses: Sequence[npt.NDArray[np.int32]],
        allowed: Sequence[npt.NDArray[np.int32]],
    ) -> TokenBatch:
        b = len(prompts)
        width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
        rmax = max(len(r) for r in responses)
        ids = torch.zeros(b, width, dtype=torch.long)
        mask = torch.zeros(b, width, dtype=torch.long)
        targets = torch.zeros(b, rmax, dtype=torch.long)
        rmask = torch.zeros(b, rmax)
        index = torch.zeros(b, rmax, dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            n = len(p) + len(r)
            ids[i, :n] = torch.from_numpy(np.concatenate([p, r]).astype(np.int64))
            mask[i, :n] = 1
            targets[i, : len(r)] = torch.from_numpy(r.astype(np.int64))
            rmask[i, : len(r)] = 1
            index[i, : len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        return cls(ids, mask, targets, rmask, index, list(allowed))


def _response_log_softmax(model: torch.nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    """[B, R, V] log-probabilities of every vocabulary id at each response position (engine convention:
    logits / temperature, ids outside a row's allowed ids at -inf)."""
    device = next(model.parameters()).device
    logits = model_logits(model, batch.input_ids.to(device), batch.attention_mask.to(device))
    idx = batch.gather_index.to(device)
    picked = logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1])).float()
    picked = picked / max(temperature, 1e-5)
    if any(len(a) for a in batch.allowed):
        bias = torch.zeros_like(picked)
        for i, a in enumerate(batch.allowed):
            if len(a):
                row = torch.full((picked.shape[-1],), float("-inf"), device=device)
                row[torch.from_numpy(a.astype(np.int64)).to(device)] = 0.0
                bias[i] = row
        picked = picked + bias
    return torch.log_softmax(picked, dim=-1)


def _of_targets(batch: TokenBatch, logp: torch.Tensor) -> torch.Tensor:
    """[B, R] the entries of `logp` [B, R, V] at the response tokens, 0 at padding."""
    return _real(batch, logp.gather(2, batch.targets.to(logp.device)[..., None])[..., 0])


def _real(batch: TokenBatch, values: torch.Tensor) -> torch.Tensor:
    # Padding positions may hold -inf (the pad id is outside a row's allowed ids): select, never
    # multiply, or -inf * 0 turns the whole loss into NaN.
    mask = batch.response_mask.to(values.device) > 0
    return torch.where(mask, values, torch.zeros_like(values))


def sequence_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
    """[B, R] log-probabilities of the response tokens (engine convention: logits / temperature,
    restricted to each row's allowed ids)."""
    return _of_targets(batch, _response_log_softmax(model, batch, temperature))


def sequence_logprobs_and_entropy(
    model: torch.nn.Module, batch: TokenBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """sequence_logprobs and [B, R] the entropy of each response position's distribution (over its
    allowed ids), both from one forward pass."""
    logp = _response_log_softmax(model, batch, temperature)
    # p log p is 0 where p is 0 (an id outside the allowed ones). Replace -inf before the product as
    # well as after it: exp(-inf) * -inf is NaN, and its gradient would be NaN even where not selected.
    allowed = torch.isfinite(logp)
    safe = torch.where(allowed, logp, torch.zeros_like(logp))
    plogp = torch.where(allowed, safe.exp() * safe, torch.zeros_like(safe))
    return _of_targets(batch, logp), _real(batch, -plogp.sum(-1))


def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Sum over real tokens of the per-token loss ([B, R] inputs, `adv` per row [B]); `entropy` (per
    token, with gradient) is rewarded with weight `cfg.entropy_coef`."""
    a = adv[:, None].to(logp.dtype)
    ratio = torch.exp(logp - prox_logp.detach())
    clipped = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
    raw_w = torch.exp((prox_logp - behav_logp).detach())
    w = torch.clamp(raw_w, max=cfg.is_cap)
    per_token = -torch.min(ratio * a, clipped * a) * w
    kl = torch.zeros_like(logp)
    if ref_logp is not None and cfg.kl_coef > 0:
        d = ref_logp.detach() - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * entropy
    m = mask.to(logp.dtype)
    n = int(m.sum().item())
    denom = max(n, 1)
    stats = LossStats(
        tokens=n,
        clip_frac=float((((ratio - clipped).abs() > 1e-6).float() * m).sum()) / denom,
        is_weight_mean=float((w * m).sum()) / denom,
        is_truncated_frac=float(((raw_w > cfg.is_cap).float() * m).sum()) / denom,
        kl=float((kl.detach() * m).sum()) / denom,
        entropy=float((entropy.detach() * m).sum()) / denom if entropy is not None else 0.0,
    )
    return torch.where(m > 0, per_token, torch.zeros_like(per_token)).sum(), stats
