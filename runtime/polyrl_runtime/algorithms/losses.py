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

Log-probabilities are computed from the model's final hidden states at the response positions, a chunk
of positions at a time (logits -> / temperature -> allowed ids -> log-softmax -> picked id, entropy),
each chunk checkpointed: no float32 [rows, tokens, vocab] tensor exists in forward or backward, which at
a 151,936-token vocabulary would be gigabytes per micro-batch.

Each row is scored at the temperature its tokens were sampled at (`TokenBatch.temperatures`, from
`Turn.temperature`): a per-call temperature differs from the policy's, and scoring it at the policy's
would take the trainer's logprobs from another distribution than the behaviour logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.utils.checkpoint

from polyrl_operator.api.algorithm import Algorithm
from polyrl_runtime.models.tiny import TinyCausalLM

# Float32 logits per chunk (64 MiB; a chunk holds several tensors of this size in backward).
LOGITS_PER_CHUNK = 1 << 24


@dataclass(frozen=True)
class LossConfig:
    clip_eps: float = 0.2
    is_cap: float = 2.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    clip_eps_high: float | None = None  # DAPO clip-higher; None: clip_eps
    dual_clip: float | None = None  # dual-clip PPO's c > 1; None: no lower bound on negative advantages
    kl_estimator: str = "k3"
    loss_aggregation: str = "token-mean"
    is_correction: str = "token-truncate"
    ratio_level: str = "token"
    kl_in: str = "loss"  # reward: the KL is in the advantages (algorithms/kl_reward.py), not the loss

    @classmethod
    def of(cls, algo: Algorithm) -> LossConfig:
        return cls(
            clip_eps=algo.clip_eps,
            is_cap=algo.is_cap,
            kl_coef=algo.kl_coef,
            entropy_coef=algo.entropy_coef,
            clip_eps_high=algo.clip_eps_high,
            dual_clip=algo.dual_clip,
            kl_estimator=algo.kl_estimator,
            loss_aggregation=algo.loss_aggregation,
            is_correction=algo.is_correction,
            ratio_level=algo.ratio_level,
            kl_in=algo.kl_in,
        )


def kl_penalty(d: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per token, the KL(pi || ref) estimate from d = log ref - log pi at the sampled token (Schulman's
    k1, k2, k3)."""
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2, k3)")


IS_CORRECTIONS = ("token-truncate", "sequence-truncate", "token-mask", "sequence-mask", "none")
MASKING_CORRECTIONS = frozenset({"token-mask", "sequence-mask"})


def importance_weights(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, R] the (detached) importance weight of each token under `mode` and [B, R] whether the
    correction acted on it: truncated at `cap` (the truncate modes) or masked out of the loss (the
    mask modes: weight 0).

    The sequence modes take the product over a row's trained tokens in log space, so a long
    sequence's product neither overflows nor underflows. The mask modes (masked importance sampling,
    Yao et al. 2025; verl's rollout-correction mask presets) keep the weight where it lies within
    [1 / cap, cap] and reject the token (token-mask) or the whole row (sequence-mask) elsewhere:
    a sample the engine's policy and the trainer's disagree on that much is not trained on at all,
    where truncation would still train on it with a bounded weight."""
    d = (prox_logp - behav_logp).detach()
    log_cap = math.log(cap)
    if mode == "token-truncate":
        return torch.clamp(torch.exp(d), max=cap), d > log_cap
    if mode == "token-mask":
        out = d.abs() > log_cap
        return torch.where(out, torch.zeros_like(d), torch.exp(d)), out
    if mode in ("sequence-truncate", "sequence-mask"):
        log_w = (torch.where(mask > 0, d, torch.zeros_like(d))).sum(-1, keepdim=True)
        if mode == "sequence-truncate":
            over = (log_w > log_cap).expand_as(d)
            return torch.exp(torch.clamp(log_w, max=log_cap)).expand_as(d), over
        out = log_w.abs() > log_cap
        w = torch.where(out, torch.zeros_like(log_w), torch.exp(torch.clamp(log_w, -log_cap, log_cap)))
        return w.expand_as(d), out.expand_as(d)
    if mode == "none":
        return torch.ones_like(d), torch.zeros_like(d, dtype=torch.bool)
    raise ValueError(f"unknown isCorrection {mode!r} ({', '.join(IS_CORRECTIONS)})")


RATIO_LEVELS = ("token", "sequence")


def probability_ratio(
    logp: torch.Tensor, prox_logp: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """[B, R] the ratio pi / pi_proximal that the loss clips, with gradient through `logp`.

    token: each token's own. sequence (GSPO, Zheng et al. 2025): s = exp(mean over the row's trained
    tokens of log pi - log pi_proximal), in the GSPO-token form sg(s) * pi / sg(pi): its value is s
    at every token of the row, and its gradient s * grad log pi at each token, so that under
    seq-mean-token-mean the gradient is GSPO's s * mean_t grad log pi."""
    d = logp - prox_logp.detach()
    if level == "token":
        return torch.exp(d)
    if level == "sequence":
        m = mask.to(logp.dtype)
        mean = (torch.where(m > 0, d, torch.zeros_like(d)).sum(-1) / m.sum(-1).clamp(min=1.0)).detach()
        return torch.exp(mean)[:, None] * torch.exp(logp - logp.detach())
    raise ValueError(f"unknown ratioLevel {level!r} ({', '.join(RATIO_LEVELS)})")


LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def aggregate_numerator(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The share of one micro-batch in the step's loss numerator ([B, R] inputs): the step's loss is
    the sum of its micro-batches' numerators over `aggregation_denominator` (all-reduced counts).

    token-mean: sum over trained tokens; seq-mean-token-sum: the same sum (a sequence's token sums,
    to be divided by the sequence count); seq-mean-token-mean: sum over rows of each row's token mean
    (a row without trained tokens adds 0)."""
    m = mask.to(per_token.dtype)
    masked = torch.where(m > 0, per_token, torch.zeros_like(per_token))
    if mode in ("token-mean", "seq-mean-token-sum"):
        return masked.sum()
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / m.sum(-1).clamp(min=1.0)).sum()
    raise ValueError(f"unknown lossAggregation {mode!r} ({', '.join(LOSS_AGGREGATIONS)})")


def aggregation_denominator(mode: str, tokens: float, sequences: float) -> float:
    """What the step's summed numerators are divided by: its trained-token count (token-mean) or its
    sequence count (the seq-mean modes), both over every rank and micro-batch; at least 1."""
    if mode == "token-mean":
        return max(tokens, 1.0)
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return max(sequences, 1.0)
    raise ValueError(f"unknown lossAggregation {mode!r} ({', '.join(LOSS_AGGREGATIONS)})")


@dataclass(frozen=True)
class LossStats:
    tokens: int
    clip_frac: float
    is_weight_mean: float
    is_truncated_frac: float
    kl: float
    entropy: float
    is_masked_frac: float = 0.0  # trained tokens a mask correction rejected (weight 0)


@dataclass(frozen=True)
class TokenBatch:
    """Padded model inputs for a list of (prompt, response, allowed) rows, plus where responses sit."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, R] response token ids (0 where padded)
    response_mask: torch.Tensor  # [B, R] 1 for trained response tokens (sampled; not context, not padding)
    gather_index: torch.Tensor  # [B, R] position of the logits that predict each response token
    allowed: list[npt.NDArray[np.int32]]
    # [B] float32 each row's sampling temperature; None: every row at the temperature the scoring
    # call is given.
    temperatures: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        prompts: Sequence[npt.NDArray[np.int32]],
        responses: Sequence[npt.NDArray[np.int32]],
        allowed: Sequence[npt.NDArray[np.int32]],
        loss_masks: Sequence[npt.NDArray[np.bool_]] | None = None,
        temperatures: Sequence[float] | None = None,
    ) -> TokenBatch:
        """`loss_masks` (per row, one flag per response token; default all True): context tokens of a
        conversation are model input only: they are neither scored nor in the loss. `temperatures`
        (per row): what each row is scored at (default: the scoring call's temperature)."""
        b = len(prompts)
        if temperatures is not None and len(temperatures) != b:
            raise ValueError(f"{len(temperatures)} temperatures for {b} rows")
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
            rmask[i, : len(r)] = (
                1 if loss_masks is None else torch.from_numpy(loss_masks[i].astype(np.float32))
            )
            index[i, : len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        temps = None if temperatures is None else torch.tensor(list(temperatures), dtype=torch.float32)
        return cls(ids, mask, targets, rmask, index, list(allowed), temps)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DeepSpeed engine (its `.module`), else the model itself (a PeftModel included:
    it resolves `get_output_embeddings` through to the wrapped model, with its LoRA layers in place)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _hidden_states(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T, H] the final hidden states (after the last norm), from one call of `model` itself: a
    DeepSpeed engine must see its forward called, or its backward prologue never runs."""
    if isinstance(_unwrap(model), TinyCausalLM):
        hidden: torch.Tensor = model(ids, attention_mask=mask, return_hidden=True)
        return hidden
    # logits_to_keep=1: the model's own head runs on one position per row only ([B, 1, V]).
    out = model(ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1, use_cache=False)
    last = out.hidden_states[-1]
    assert isinstance(last, torch.Tensor)
    return last


def _output_head(model: torch.nn.Module) -> tuple[torch.nn.Module, float | None]:
    """The module mapping hidden states to logits and the model's final logit soft-cap (Gemma 2), if any."""
    inner = _unwrap(model)
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Module):
        raise ValueError(f"{type(inner).__name__} has no output embeddings (lm_head): cannot score tokens")
    softcap = getattr(getattr(inner, "config", None), "final_logit_softcapping", None)
    return head, float(softcap) if softcap else None


def chunk_tokens_for(vocab: int) -> int:
    """Positions per chunk so that one chunk's float32 logits stay near `LOGITS_PER_CHUNK` elements."""
    return max(16, min(4096, LOGITS_PER_CHUNK // max(vocab, 1)))


@dataclass(frozen=True)
class _ChunkScorer:
    """Scores a chunk of C positions: [1 or 2, C], the log-probability of each target (and the
    entropy of its distribution). Engine convention: logits / temperature (`temps[row]` when given,
    the rows' temperatures clamped at 1e-5, else `temperature`), ids outside the row's allowed ids
    at -inf."""

    head: torch.nn.Module
    softcap: float | None
    temperature: float
    with_entropy: bool

    def __call__(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        rows: torch.Tensor,
        keep: torch.Tensor | None,
        temps: torch.Tensor | None,
    ) -> torch.Tensor:
        logits = self.head(hidden).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scaled = logits / max(self.temperature, 1e-5) if temps is None else logits / temps[rows][:, None]
        if keep is not None:
            scaled = scaled.masked_fill(~keep[rows], float("-inf"))
        logp = torch.log_softmax(scaled, dim=-1)
        picked = logp.gather(1, targets[:, None])[:, 0]
        if not self.with_entropy:
            return picked[None]
        # p log p is 0 where p is 0 (an id outside the allowed ones). Replace -inf before the product as
        # well as after it: exp(-inf) * -inf is NaN, and its gradient would be NaN even where not selected.
        finite = torch.isfinite(logp)
        safe = torch.where(finite, logp, torch.zeros_like(logp))
        plogp = torch.where(finite, safe.exp() * safe, torch.zeros_like(safe))
        return torch.stack([picked, -plogp.sum(-1)])


def _allowed_mask(
    allowed: Sequence[npt.NDArray[np.int32]], vocab: int, device: torch.device
) -> torch.Tensor | None:
    """[B, V] True where a row may emit an id (every id for a row without a restriction); None when no
    row is restricted. One row of V booleans per sequence, shared by every chunk."""
    if not any(len(a) for a in allowed):
        return None
    keep = torch.ones(len(allowed), vocab, dtype=torch.bool, device=device)
    for i, a in enumerate(allowed):
        if len(a):
            keep[i] = False
            keep[i, torch.from_numpy(a.astype(np.int64)).to(device)] = True
    return keep


def _row_temperatures(
    batch: TokenBatch, temperature: float, device: torch.device
) -> tuple[float, torch.Tensor | None]:
    """The one temperature every row is scored at, or [B] the rows' own (clamped at 1e-5, as the
    engine does) when they differ. Rows of one temperature divide by a scalar, as the engine's batch
    of one temperature does (engines/sampling.py): on CUDA a scalar divisor is a multiplication by
    its reciprocal, which may differ from a tensor division in the last bit."""
    t = batch.temperatures
    if t is None or not len(t):
        return temperature, None
    if bool((t == t[0]).all()):
        return float(t[0]), None
    return temperature, t.clamp(min=1e-5).to(device)


def _response_scores(
    model: torch.nn.Module,
    batch: TokenBatch,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int | None,
) -> torch.Tensor:
    """[1 or 2, B, R] response-token log-probabilities (and entropies), 0 at padding.

    Only the real response positions are scored, `chunk_tokens` at a time; with gradient each chunk is
    checkpointed (recomputed in backward), so neither pass holds more than one chunk's [C, V] logits."""
    device = next(model.parameters()).device
    hidden = _hidden_states(model, batch.input_ids.to(device), batch.attention_mask.to(device))
    head, softcap = _output_head(model)
    real = batch.response_mask > 0
    r_idx, c_idx = real.nonzero(as_tuple=True)
    r_dev, c_dev = r_idx.to(device), c_idx.to(device)
    h = hidden[r_dev, batch.gather_index.to(device)[r_dev, c_dev]]  # [N, H]
    targets = batch.targets.to(device)[r_dev, c_dev]
    vocab = int(getattr(head, "out_features", 0)) or int(head(h[:1]).shape[-1])
    keep = _allowed_mask(batch.allowed, vocab, device)
    temperature, temps = _row_temperatures(batch, temperature, device)
    step = chunk_tokens or chunk_tokens_for(vocab)
    checkpoint = torch.is_grad_enabled() and h.requires_grad
    fn = _ChunkScorer(head, softcap, temperature, with_entropy)
    parts: list[torch.Tensor] = []
    for lo in range(0, h.shape[0], step):
        args = (h[lo : lo + step], targets[lo : lo + step], r_dev[lo : lo + step], keep, temps)
        if checkpoint:
            part = torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
            assert isinstance(part, torch.Tensor)
        else:
            part = fn(*args)
        parts.append(part)
    k = 2 if with_entropy else 1
    values = torch.cat(parts, dim=1) if parts else torch.zeros(k, 0, device=device)
    out = torch.zeros(k, *batch.targets.shape, device=device, dtype=values.dtype)
    return out.index_put((torch.arange(k, device=device)[:, None], r_dev[None], c_dev[None]), values)


def sequence_logprobs(
    model: torch.nn.Module, batch: TokenBatch, temperature: float = 1.0, *, chunk_tokens: int | None = None
) -> torch.Tensor:
    """[B, R] log-probabilities of the response tokens (engine convention: logits / temperature,
    restricted to each row's allowed ids), 0 at padding. Each row at its own temperature when the
    batch carries them (`TokenBatch.temperatures`), else all at `temperature`."""
    return _response_scores(model, batch, temperature, False, chunk_tokens)[0]


def sequence_logprobs_and_entropy(
    model: torch.nn.Module, batch: TokenBatch, temperature: float = 1.0, *, chunk_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """sequence_logprobs and [B, R] the entropy of each response position's distribution (over its
    allowed ids), both from one forward pass."""
    scores = _response_scores(model, batch, temperature, True, chunk_tokens)
    return scores[0], scores[1]


KL_IN = ("loss", "reward")


def per_token_advantages(adv: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """[B, R] advantages in `logp`'s dtype from per-row [B] (one for every token of the row) or
    per-token [B, R] ones."""
    if adv.dim() == 1 and adv.shape[0] == logp.shape[0]:
        return adv[:, None].to(logp.dtype)
    if adv.shape == logp.shape:
        return adv.to(logp.dtype)
    raise ValueError(
        f"advantages of shape {tuple(adv.shape)}: need one per row {tuple(logp.shape[:1])} or one per "
        f"token {tuple(logp.shape)}"
    )


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
    """The micro-batch's loss numerator (`aggregate_numerator` under `cfg.loss_aggregation`: the sum
    over real tokens of the per-token loss for token-mean) ([B, R] inputs; `adv` per row [B] or per
    token [B, R]); `entropy` (per token, with gradient) is rewarded with weight `cfg.entropy_coef`.
    The KL to `ref_logp` is a term of the loss under `cfg.kl_in` loss; under reward it is in the
    advantages already, and only reported. Stats are per token whatever the aggregation."""
    a = per_token_advantages(adv, logp)
    m = mask.to(logp.dtype)
    ratio = probability_ratio(logp, prox_logp, m, cfg.ratio_level)
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    clipped = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + high)
    w, corrected = importance_weights(prox_logp, behav_logp, m, cfg.is_correction, cfg.is_cap)
    corrected_frac = float((corrected.float() * m).sum()) / max(int(m.sum().item()), 1)
    masking = cfg.is_correction in MASKING_CORRECTIONS
    objective = torch.min(ratio * a, clipped * a)
    if cfg.dual_clip is not None:  # a negative advantage's objective is bounded below by c * a
        objective = torch.where(a < 0, torch.max(objective, cfg.dual_clip * a), objective)
    per_token = -objective * w
    if cfg.kl_in not in KL_IN:
        raise ValueError(f"unknown klIn {cfg.kl_in!r} ({', '.join(KL_IN)})")
    kl = torch.zeros_like(logp)
    if ref_logp is not None and cfg.kl_coef > 0:
        in_loss = cfg.kl_in == "loss"
        kl = kl_penalty(ref_logp.detach() - (logp if in_loss else logp.detach()), cfg.kl_estimator)
        if in_loss:
            per_token = per_token + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * entropy
    n = int(m.sum().item())
    denom = max(n, 1)
    stats = LossStats(
        tokens=n,
        clip_frac=float((((ratio - clipped).abs() > 1e-6).float() * m).sum()) / denom,
        is_weight_mean=float((w * m).sum()) / denom,
        is_truncated_frac=0.0 if masking else corrected_frac,
        is_masked_frac=corrected_frac if masking else 0.0,
        kl=float((kl.detach() * m).sum()) / denom,
        entropy=float((entropy.detach() * m).sum()) / denom if entropy is not None else 0.0,
    )
    return aggregate_numerator(per_token, m, cfg.loss_aggregation), stats
