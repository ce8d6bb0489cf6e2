"""The experience buffer's state and the bookkeeping that keeps its accounting exact, under its lock:
ids, ticket and lease lookup, requeues, counted drops and the settling of rows that became final
(credit and residency follow). The public protocol (acquire/put, pull/ack, advance, snapshots) is
`ExperienceBuffer` in buffer.py, built on this."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt
import structlog

from polyrl_runtime.experience import columns
from polyrl_runtime.experience.columns import Chunk, Segment
from polyrl_runtime.experience.state import (
    FILTERED_KEY,
    DropReason,
    LeaseState,
    PolicyConfig,
    PolicyState,
    UnknownLeaseError,
    UnknownTicketError,
)
from polyrl_runtime.experience.types import EpisodeHead, Ticket, version_skew

log = structlog.get_logger(__name__)

Rows = npt.NDArray[np.bool_]  # one flag per row of a chunk


class BufferCore:
    """State of all policies' buffers of one job; every method here runs with `_cond` held."""

    def __init__(self, policies: Sequence[PolicyConfig], capacity_episodes: int) -> None:
        if capacity_episodes < 1:
            raise ValueError("capacity_episodes must be >= 1")
        self.capacity_episodes = capacity_episodes
        self._p = {c.name: PolicyState(c) for c in policies}
        self._cond = threading.Condition()
        self._tickets: dict[int, Ticket] = {}
        self._leases: dict[int, LeaseState] = {}
        # Episodes with a sample not yet final. Per (episode, policy) pair, each chunk counts the
        # samples not yet final and those consumed: credit comes back when a pair ends with nothing
        # consumed; an episode stays resident while any of its pairs is live.
        self._live_episodes = 0
        self._next_id = 1
        self._cancelled = False

    def _take_id(self) -> int:
        i = self._next_id
        self._next_id += 1
        return i

    def _pop_ticket(self, ticket: Ticket) -> Ticket:
        t = self._tickets.pop(ticket.ticket_id, None)
        if t is None:
            raise UnknownTicketError(f"ticket {ticket.ticket_id} is not outstanding")
        return t

    def _pop_lease(self, lease_id: int) -> LeaseState:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise UnknownLeaseError(f"lease {lease_id} is not outstanding")
        return lease

    def _requeue(self, lease: LeaseState) -> None:
        p = self._p[lease.policy]
        p.redelivered += lease.n
        if p.finished:
            for c, i, j in lease.segments:
                self._drop(p, c, slice(i, j), j - i, DropReason.POLICY_FINISHED)
            return
        p.queue.extendleft(reversed(lease.segments))
        p.buffered += lease.n

    def _drop_stale(self, p: PolicyState, c: Chunk, i: int, j: int) -> list[Segment]:
        """Drop rows i..j-1 of `c` that are too stale for `p`; returns the ranges of those kept."""
        stale = p.version - c.min_version[i:j] > p.cfg.max_staleness
        rows = np.flatnonzero(stale)
        if len(rows):
            self._drop(p, c, rows + i, len(rows), DropReason.STALE)
        return [(c, i + a, i + b) for a, b in columns.runs(~stale)]

    def _drop_filtered(self, p: PolicyState, c: Chunk, heads: Sequence[EpisodeHead]) -> Rows:
        """Drop the rows of `c` the workflow worker marked in their episode's metadata
        (`FILTERED_KEY`): overlong turns always; equal-reward groups while the version's dropped
        pairs stay within `zero_variance_cap` (past it the version keeps them, so that a policy
        whose every group has equal rewards still steps). Returns which rows are kept."""
        keep = np.ones(len(c), dtype=np.bool_)
        marks = [heads[e][3].get(FILTERED_KEY) for e in range(len(heads))]
        if not any(marks):
            return keep
        reasons: dict[DropReason, Rows] = {}
        for row, (e, turn) in enumerate(zip(c.row_episode.tolist(), c.turn_index.tolist(), strict=True)):
            mark = marks[e]
            if not mark:
                continue
            for reason in (DropReason.OVERLONG, DropReason.ZERO_VARIANCE):
                if turn in mark.get(reason.value, ()):
                    reasons.setdefault(reason, np.zeros(len(c), dtype=np.bool_))[row] = True
                    break
        zero = reasons.pop(DropReason.ZERO_VARIANCE, None)
        cap = p.cfg.zero_variance_cap
        if zero is not None and cap is not None:
            pairs = len(np.unique(c.row_pair[zero]))
            if p.zero_variance_dropped + pairs <= cap:
                p.zero_variance_dropped += pairs
                reasons[DropReason.ZERO_VARIANCE] = zero
            elif p.zero_variance_dropped <= cap:
                p.zero_variance_dropped = cap + 1  # warn once per version
                log.warning(
                    "experience.dynamic_sampling_cap",
                    policy=p.cfg.name,
                    version=p.version,
                    cap_pairs=cap,
                    detail="this version dropped algorithm.dynamicSampling.maxRefills steps' worth "
                    "of equal-reward groups: it trains on the next ones (zero signal) to step",
                )
        for reason, rows in reasons.items():
            idx = np.flatnonzero(rows)
            self._drop(p, c, idx, len(idx), reason)
            keep &= ~rows
        return keep

    def _drop_skewed(self, p: PolicyState, c: Chunk, keep: Rows) -> list[Segment]:
        """Drop the rows of `c` still kept (`keep`) whose episodes' policies still training are
        further apart than `p`'s bound; returns the ranges of those kept. Every chunk of a put
        decides alike: they share the episodes' version vectors, and no policy finishes during a
        put."""
        bound = p.cfg.max_version_skew
        if bound is not None:
            over = np.array([self._skew(v) > bound for v in c.episode_versions], dtype=np.bool_)
            skewed = over[c.row_episode] & keep
            rows = np.flatnonzero(skewed)
            if len(rows):
                self._drop(p, c, rows, len(rows), DropReason.VERSION_SKEW)
                keep = keep & ~skewed
        return [(c, a, b) for a, b in columns.runs(keep)]

    def _skew(self, vector: Mapping[str, int]) -> int:
        """The version skew of an episode among its policies still training: a policy that has
        finished stays at its last version, and the others must still be able to catch up."""
        return version_skew(
            {n: v for n, v in vector.items() if not (self._p[n].finished or self._p[n].restarting)}
        )

    def _drop_queue(self, p: PolicyState, reason: DropReason) -> None:
        for c, i, j in p.queue:
            self._drop(p, c, slice(i, j), j - i, reason)
        p.queue.clear()
        p.buffered = 0

    def _drop(
        self, p: PolicyState, c: Chunk, rows: slice | columns.Index, n: int, reason: DropReason
    ) -> None:
        p.dropped[reason] += n
        log.debug("experience.drop", policy=p.cfg.name, samples=n, reason=reason.value)
        self._settle(c, rows, consumed=False)

    def _settle(self, c: Chunk, rows: slice | columns.Index, *, consumed: bool) -> None:
        """Rows became final: their pairs' credit and their episodes' residency follow."""
        credit_back, ended = columns.settle(c, rows, consumed=consumed)
        self._p[c.policy].admitted -= credit_back  # pairs that ended with nothing trained on
        self._live_episodes -= ended

    def _pairs_ahead(self, name: str) -> int:
        """The policy's (episode, policy) pairs that, in sync mode, count against its current
        version: those with a sample buffered (once a new version has dropped the stale ones, the
        rest are of that version) and tickets out naming it (their episodes, of an older version,
        will be dropped on arrival and give their credit back). Leased samples are not: their
        trainer acknowledges them for the version they were leased at."""
        pairs: set[tuple[int, int]] = set()
        for c, i, j in self._p[name].queue:
            pairs.update((id(c), k) for k in np.unique(c.row_pair[i:j]).tolist())
        return len(pairs) + sum(1 for t in self._tickets.values() if name in t.policies)

    def wait(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        if timeout is None:
            self._cond.wait_for(ready)
            return True
        if timeout <= 0:
            return bool(ready())
        deadline = time.monotonic() + timeout
        return bool(self._cond.wait_for(ready, timeout=max(0.0, deadline - time.monotonic())))
