"""The KL penalty in the reward (`algorithm.klIn: reward`; REINFORCE++, Hu 2025).

Per trained token t of a sequence with reward r, kl_t is the KL estimate (`klEstimator`) of the
policy against the reference at that token, taken from the proximal log-probabilities (the weights
when the step began, before any update) and without gradient. The token's return is

    G_t = r - klCoef * sum over trained t' >= t of kl_t'     (gamma 1)

and its advantage is G_t normalised as `advantageNorm` says, with statistics over the trained tokens
of the policy's step batch (all ranks) instead of over its rows: per-policy centres by their mean and
divides by their standard deviation. The loss then carries no KL term (`LossConfig.kl_in`).

Only the estimators whose signal is the raw reward (reinforce_pp, ppo): a grouped estimator's signal
is centred within its group, and a per-token shaping would undo that centring (the API refuses it).
Context tokens of a conversation (not trained) carry no KL and get advantage 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from polyrl_runtime.algorithms.advantages import AdvantageStats, advantages, scale_stats
from polyrl_runtime.algorithms.estimators import estimator
from polyrl_runtime.algorithms.losses import kl_penalty


def token_kl(ref_logp: torch.Tensor, prox_logp: torch.Tensor, kl_estimator: str) -> torch.Tensor:
    """[B, R] the detached KL estimate of each token, from the reference and proximal logprobs."""
    return kl_penalty((ref_logp - prox_logp).detach(), kl_estimator)


def kl_to_go(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] at each position the sum of `kl` over the row's trained positions from it to the end."""
    masked = torch.where(mask > 0, kl, torch.zeros_like(kl))
    return masked.flip(-1).cumsum(-1).flip(-1)


def shaped_returns(
    rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """[B, R] each trained token's return: its row's reward ([B]) minus `kl_coef` times the KL to go;
    0 at positions that are not trained."""
    g = rewards[:, None].to(kl.dtype) - kl_coef * kl_to_go(kl, mask)
    return torch.where(mask > 0, g, torch.zeros_like(g))


def trained_values(per_token: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """1-D the values at the trained positions of each [b, R] tensor, row-major, on the CPU."""
    parts = [t.detach().cpu()[m.cpu() > 0] for t, m in zip(per_token, masks, strict=True)]
    return torch.cat(parts) if parts else torch.zeros(0)


def at_trained_positions(values: torch.Tensor, masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of `trained_values`: for each mask a [b, R] tensor (on the CPU) holding the next
    values at its trained positions, row-major, and 0 elsewhere."""
    keeps = [m.cpu() > 0 for m in masks]
    counts = [int(k.sum()) for k in keeps]
    if sum(counts) != len(values):
        raise ValueError(f"{len(values)} values for {sum(counts)} trained positions")
    out: list[torch.Tensor] = []
    for keep, part in zip(keeps, torch.split(values, counts), strict=True):
        t = torch.zeros(keep.shape, dtype=values.dtype)
        t[keep] = part
        out.append(t)
    return out


AgentStats = Callable[[torch.Tensor, tuple[str, ...]], Mapping[str, AdvantageStats]]


def token_advantages(
    returns: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    row_agents: Sequence[Sequence[str]],
    mode: str,
    *,
    algorithm: str,
    allreduce: Callable[[list[float]], list[float]],
    agent_stats: AgentStats,
    global_std: float | None = None,
) -> list[torch.Tensor]:
    """Per [b, R] return tensor (one per micro-batch, `row_agents` its rows' agents), its advantages
    (on the CPU, 0 where not trained) under normalisation `mode`, with the statistics of every trained
    token of the step: `allreduce` sums [count, total, total_sq] over the ranks, and `agent_stats`
    (per-agent only) gives each agent's statistics over the ranks from this rank's token values and
    their agents. Every rank must call it, with no rows when it has none (the collectives align)."""
    if estimator(algorithm).grouped:
        raise ValueError(
            f"klIn reward needs an estimator whose signal is the raw reward (reinforce_pp, ppo), not "
            f"{algorithm!r}: its group-centred signals would be shifted per token"
        )
    values = trained_values(returns, masks)
    local = scale_stats(values, algorithm)
    count, total, total_sq = allreduce([local.count, local.total, local.total_sq])
    agents: tuple[str, ...] = ()
    by_agent: Mapping[str, AdvantageStats] | None = None
    if mode == "per-agent":
        agents = tuple(
            agent
            for rows, m in zip(row_agents, masks, strict=True)
            for agent, n in zip(rows, (m > 0).sum(-1).tolist(), strict=True)
            for _ in range(int(n))
        )
        by_agent = agent_stats(values, agents)
    adv = advantages(
        values,
        mode,
        AdvantageStats(count, total, total_sq),
        algorithm=algorithm,
        global_std=global_std,
        agents=agents,
        by_agent=by_agent,
    )
    return at_trained_positions(adv, masks)
