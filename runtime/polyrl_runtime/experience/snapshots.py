"""A buffer's snapshot for a checkpoint: a pure function of its state, taken under its lock.

Leased samples count as unconsumed (the trainer that holds them restarts with the job) and their
redelivery is counted; outstanding tickets die with the process that restores, so their credit comes
back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from polyrl_runtime.experience import columns
from polyrl_runtime.experience.state import BufferSnapshot, LeaseState, PolicyState
from polyrl_runtime.experience.types import Sample, Ticket


def take_snapshot(
    policies: Mapping[str, PolicyState],
    leases: Mapping[int, LeaseState],
    tickets: Iterable[Ticket],
    capacity_episodes: int,
    cancelled: bool,
) -> BufferSnapshot:
    """Everything not yet consumed, and the counters, of a buffer in this state."""
    tickets = list(tickets)
    samples: dict[str, list[Sample]] = {}
    pairs: dict[tuple[str, str], tuple[int, int]] = {}
    for name, p in policies.items():
        leased = [seg for i in sorted(leases) if leases[i].policy == name for seg in leases[i].segments]
        held = leased + list(p.queue)
        samples[name] = columns.samples(held)
        for c in {id(c): c for c, _, _ in held}.values():
            for k in np.flatnonzero(c.pair_live).tolist():
                live, consumed = pairs.get((c.pair_episode[k], name), (0, 0))
                pairs[(c.pair_episode[k], name)] = (
                    live + int(c.pair_live[k]),
                    consumed + int(c.pair_consumed[k]),
                )
    counters = {
        name: {
            "version": p.version,
            # Outstanding tickets die with the process that restores: their credit comes back.
            "admitted": p.admitted - sum(1 for t in tickets if name in t.policies),
            "produced": p.produced,
            "consumed": p.consumed,
            "redelivered": p.redelivered + sum(ls.n for ls in leases.values() if ls.policy == name),
            "dropped": dict(p.dropped),
            "staleness_sum": p.staleness_sum,
            "staleness_max": p.staleness_max,
            "finished": p.finished,
            "base": p.base,
        }
        for name, p in policies.items()
    }
    return BufferSnapshot(
        configs=tuple(p.cfg for p in policies.values()),
        capacity_episodes=capacity_episodes,
        policies=counters,
        samples=samples,
        pairs=pairs,
        cancelled=cancelled,
    )
