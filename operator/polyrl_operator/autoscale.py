"""Replica decisions for elastic roles (rollout engines, workflow workers): pure, with hysteresis.

Scale out when the backlog per replica stays above a high mark for a while; scale in one replica at a
time when there is no backlog and utilisation stays below a low mark for (longer) while; hold for a
cooldown after every change. Two thresholds, two windows and the cooldown keep a noisy signal from
flapping the fleet (as the HPA's stabilisation window does). The state is a few timestamps kept by
the reconciler; losing it (operator restart) only restarts the windows, which is conservative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from polyrl_operator.settings import Autoscale


@dataclass(frozen=True)
class ScaleState:
    high_since: float | None = None
    low_since: float | None = None
    last_change: float | None = None


@dataclass(frozen=True)
class Signals:
    """What /progress says about one elastic role."""

    backlog: int
    """Work waiting for a replica (generation requests or episodes)."""
    utilisation: float
    """Mean busy fraction of the replicas that are not draining (0..1)."""
    ready: int
    """Replicas ready now; no decision is taken while the fleet is still changing."""


@dataclass(frozen=True)
class Decision:
    desired: int
    state: ScaleState
    reason: str | None = None
    """Why desired changed (None: unchanged)."""


def decide(
    current: int,
    lo: int,
    hi: int,
    *,
    signals: Signals | None,
    state: ScaleState,
    now: float,
    params: Autoscale,
) -> Decision:
    """The replica count to want next, within ``[lo, hi]``."""
    hi = max(hi, lo)
    if current < lo:
        return Decision(lo, replace(state, last_change=now), f"raised to the minimum {lo}")
    if current > hi:
        return Decision(hi, replace(state, last_change=now), f"lowered to the maximum {hi}")
    if signals is None or signals.ready < current:
        # No data, or the fleet is still starting/draining: decide nothing, restart the windows.
        return Decision(current, replace(state, high_since=None, low_since=None))
    per_replica = signals.backlog / max(current, 1)
    high = per_replica > params.backlog_high
    low = signals.backlog == 0 and signals.utilisation < params.utilisation_low
    state = ScaleState(
        high_since=(state.high_since if state.high_since is not None else now) if high else None,
        low_since=(state.low_since if state.low_since is not None else now) if low else None,
        last_change=state.last_change,
    )
    if state.last_change is not None and now - state.last_change < params.cooldown:
        return Decision(current, state)
    if high and current < hi and state.high_since is not None and now - state.high_since >= params.out_window:
        target = math.ceil(signals.backlog / params.backlog_high)
        desired = min(hi, max(current + 1, target))
        return Decision(
            desired,
            ScaleState(last_change=now),
            f"backlog {signals.backlog} is {per_replica:.1f} per replica (> {params.backlog_high:g})",
        )
    if low and current > lo and state.low_since is not None and now - state.low_since >= params.in_window:
        return Decision(
            current - 1,
            ScaleState(last_change=now),
            f"no backlog and utilisation {signals.utilisation:.2f} (< {params.utilisation_low:g})",
        )
    return Decision(current, state)
