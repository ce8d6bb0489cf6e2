"""A policy starved by drops: episodes keep coming, but every sample of it is dropped on arrival.

The stall check (training.py) sees nothing wrong then: credit is granted, episodes are in flight.
Two drops can go on forever: `version_skew` (onVersionSkew drop, a policy too far behind the others)
and `stale` (its engines serve versions too old for its trainer, e.g. never receiving its weights).
A policy that gets no sample for the stall timeout while such drops go on fails the job, naming
the reason, rather than dropping forever."""

from __future__ import annotations

import time

from polyrl_runtime.experience.buffer import DropReason, PolicyStats

STARVING = (DropReason.STALE, DropReason.VERSION_SKEW)


class Starvation:
    """Whether, while a policy waits for a step, samples stopped arriving and were dropped (for a
    reason in `STARVING`) all the while."""

    def __init__(self, now: float) -> None:
        self.arrived_at, self.buffered = now, 0
        self.dropped: dict[str, int] | None = None  # at the last arrival, per reason

    def starved(self, st: PolicyStats, timeout_s: float) -> bool:
        now, dropped = time.monotonic(), {r.value: st.dropped.get(r, 0) for r in STARVING}
        if self.dropped is None or st.buffered > self.buffered or st.leased:
            self.arrived_at, self.dropped = now, dropped  # a sample arrived: starving starts again
        self.buffered = st.buffered
        return sum(dropped.values()) > sum(self.dropped.values()) and now - self.arrived_at > timeout_s

    def since(self, st: PolicyStats) -> dict[str, int]:
        """The drops, per reason, since the last sample arrived."""
        base = self.dropped or {}
        return {r.value: st.dropped.get(r, 0) - base.get(r.value, 0) for r in STARVING}
