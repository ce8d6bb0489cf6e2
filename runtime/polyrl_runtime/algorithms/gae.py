"""Generalised advantage estimation with a critic (Schulman et al. 2016) and PPO's clipped value loss,
per token of a response (`algorithm.critic`).

A sequence's time steps are its trained tokens, in order: a conversation's context tokens (tool
output, the other side's turns) are model input, not actions, so they are skipped, neither
discounted over nor given an advantage. At trained step t (token y_t, value V_t of the state before
it) with reward r_t (the sequence's reward at its last trained token, any per-token shaping such as
`-klCoef * kl_t` at every one):

    delta_t = r_t + gamma * V_{t+1} - V_t           (V after the last step: 0, the episode ends)
    A_t     = sum over l >= 0 of (gamma * lambda)^l * delta_{t+l}
    R_t     = A_t + V_t                             (the value target)

The value loss (PPO2, as verl and OpenRLHF clip it) keeps the new value within `clip` of the value
the step began with:

    L_V = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)

Every input is [B, R] (rows, response positions) with a 0/1 `mask` of trained positions; outputs
are 0 where the mask is 0.
"""

from __future__ import annotations

import torch


def token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, shaping: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, R] each trained token's reward: the row's reward ([B]) at its last trained token, plus
    `shaping` ([B, R], e.g. -klCoef * kl) at every trained token."""
    m = mask > 0
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(m, positions, torch.full_like(positions, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = rewards.to(out)[rows]
    if shaping is not None:
        out = out + torch.where(m, shaping.to(out), torch.zeros_like(out))
    return out


def gae(
    token_reward: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, R] advantages and value targets (returns) of every trained token, by the recursion from
    each row's last trained token back to its first; untrained positions are passed over (their
    value and reward do not enter) and get 0."""
    m = mask > 0
    r = token_reward.detach().float()
    v = values.detach().float()
    adv = torch.zeros_like(r)
    b = r.shape[0]
    next_value = torch.zeros(b, dtype=r.dtype, device=r.device)
    running = torch.zeros(b, dtype=r.dtype, device=r.device)
    for t in range(r.shape[1] - 1, -1, -1):
        here = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        step = delta + gamma * lam * running
        running = torch.where(here, step, running)
        next_value = torch.where(here, v[:, t], next_value)
        adv[:, t] = torch.where(here, step, torch.zeros_like(step))
    returns = torch.where(m, adv + v, torch.zeros_like(adv))
    return adv, returns


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
) -> tuple[torch.Tensor, float]:
    """The clipped value loss summed over trained tokens (divide by their count for the mean) and the
    fraction of trained tokens whose clipped term was the larger. `clip` None: unclipped."""
    m = mask.to(values.dtype)
    target = returns.detach().to(values.dtype)
    unclipped = (values - target) ** 2
    if clip is None:
        per_token, clipped_frac = unclipped, 0.0
    else:
        old = old_values.detach().to(values.dtype)
        clipped_v = old + torch.clamp(values - old, -clip, clip)
        clipped = (clipped_v - target) ** 2
        per_token = torch.max(unclipped, clipped)
        n = float(m.sum())
        clipped_frac = float(((clipped > unclipped).to(m.dtype) * m).sum()) / max(n, 1.0)
    return 0.5 * (per_token * m).sum(), clipped_frac
