"""Per-policy experience buffers with staleness credit, leases, redelivery and counted drops.

Flow: a workflow `acquire`s a ticket (credit from every policy its episode will involve), plays the
episode, and `put`s it; the episode is split into per-policy samples. A trainer `pull`s a micro-batch
under a lease and `ack`s it after its optimizer step; a trainer that dies (`consumer_failed`) or gives
a batch back (`nack`) has its samples redelivered first. `advance` records a trainer's new version.

Accounting, per policy, at every moment:  produced == buffered + leased + consumed + sum(dropped).
A sample leaves only by an ack (consumed) or a drop with a counted `DropReason`.

Back-pressure, per policy p (AReaL's staleness control): in async mode the episodes admitted for p
that have not been dropped never exceed (version_p + max_staleness + 1) * episodes_per_version, so
producers run at most `max_staleness` versions ahead; nor, for a policy with a `final_version`,
final_version * episodes_per_version (no episode is started that no step will train on). In sync mode
(max_staleness=0) each version admits episodes_per_version episodes on top of those of the earlier
versions, and the credit a failed episode gives back is granted again as a whole group, even past the
version's count: a sync step gets its full count of finished episodes, at most a group minus one more,
and nothing is started that a later version would drop as stale. A job-wide bound on resident episodes
(tickets out + episodes with samples not yet consumed or dropped) keeps memory bounded whatever the
producer/consumer speed ratio.

The types are in state.py, the bookkeeping under the lock (drops, settling, requeues) in core.py,
snapshots for checkpoints in snapshots.py; this module is the protocol producers and consumers use.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np
import structlog

from polyrl_runtime.experience import columns
from polyrl_runtime.experience.columns import Chunk, PackedEpisodes, Segment
from polyrl_runtime.experience.core import BufferCore
from polyrl_runtime.experience.snapshots import take_snapshot
from polyrl_runtime.experience.state import (
    BufferSnapshot,
    DropReason,
    Lease,
    LeaseState,
    PolicyConfig,
    PolicyState,
    PolicyStats,
    UnknownLeaseError,
    UnknownTicketError,
)
from polyrl_runtime.experience.types import Episode, EpisodeHead, Ticket

__all__ = [
    "BufferSnapshot",
    "DropReason",
    "ExperienceBuffer",
    "Lease",
    "PolicyConfig",
    "PolicyStats",
    "UnknownLeaseError",
    "UnknownTicketError",
]

log = structlog.get_logger(__name__)


class ExperienceBuffer(BufferCore):
    """All policies' buffers of one job. Thread-safe; blocking calls wait on a condition."""

    # -- producers ---------------------------------------------------------------------------

    def _policy(self, name: str) -> PolicyState:
        try:
            return self._p[name]
        except KeyError:
            raise KeyError(f"unknown policy {name!r}; known: {sorted(self._p)}") from None

    @property
    def resident_episodes(self) -> int:
        return len(self._tickets) + self._live_episodes

    def _can_admit(self, policies: frozenset[str], episodes: int = 1) -> bool:
        return self._admissible(policies, episodes) >= episodes

    def _admissible(self, policies: frozenset[str], group: int = 1) -> int:
        """How many episodes playing `policies` could be started now, in groups of `group`. Each
        ticket issued lowers this by exactly one (one more resident episode, one less credit in every
        policy it names), but for the rounding up of a sync policy's credit."""
        if self._cancelled:
            return 0
        # A finished policy takes no credit: its samples will be dropped (and counted) on arrival. An
        # episode only finished policies would play is not started at all: no step could train on it
        # (the producer ran on between the last step and the job's end: 16-20 episodes, all dropped).
        credits = [
            self._credit(self._p[n], group)
            for n in policies
            if not (self._p[n].finished or self._p[n].restarting)
        ]
        if not credits:
            return 0
        return max(0, min(self.capacity_episodes - self.resident_episodes, *credits))

    @staticmethod
    def _credit(p: PolicyState, group: int) -> int:
        """A sync policy's credit rounded up to whole groups: the credit failed episodes gave back
        (one each) is granted as a group that replaces them; granted only as what is left of the
        version's count, it was too little for a group, and the step trained short."""
        c = p.credit()
        return -(-c // group) * group if p.cfg.max_staleness == 0 and c > 0 else c

    def acquire(self, policies: Iterable[str], timeout: float | None = 0.0) -> Ticket | None:
        """Credit for one episode from each policy named (all or none); None if none came in time."""
        tickets = self.acquire_many(policies, 1, timeout)
        return tickets[0] if tickets else None

    def acquire_many(
        self, policies: Iterable[str], n: int, timeout: float | None = 0.0, *, group: int = 1
    ) -> list[Ticket]:
        """Up to `n` tickets, each as `acquire` gives one, in whole groups of `group` (GRPO's episodes
        per prompt); waits (up to `timeout`) only for the first group.

        One lock hold for the batch: a workflow asks for a batch's worth of credit per call. Whole
        groups, because credit comes back one episode at a time (a failed episode, a stale sample):
        granted as it came, it made groups of one, whose advantages are all zero, and a workflow
        failing on a group's first episode then failed forever.
        """
        names = frozenset(policies)
        if not names:
            raise ValueError("an episode involves at least one policy")
        if group < 1 or group > self.capacity_episodes:
            raise ValueError(f"group must be 1..{self.capacity_episodes} (the capacity), not {group}")
        for name in names:
            self._policy(name)
        out: list[Ticket] = []
        with self._cond:
            if n < group or not self.wait(lambda: self._can_admit(names, group), timeout):
                return out
            k = min(n, self._admissible(names, group)) // group * group
            for name in names:
                self._p[name].admitted += k
            first = self._next_id
            self._next_id += k
            out += [Ticket(i, names) for i in range(first, first + k)]
            self._tickets.update((t.ticket_id, t) for t in out)
        return out

    def release(self, ticket: Ticket) -> None:
        """Give back an unused ticket (the episode was abandoned before it produced anything)."""
        with self._cond:
            t = self._pop_ticket(ticket)
            for n in t.policies:
                self._p[n].admitted -= 1
            self._cond.notify_all()

    def put(self, ticket: Ticket, episode: Episode) -> None:
        """Accept a finished episode: every sample is buffered, or dropped with a counted reason."""
        self.put_many([(ticket, episode)])

    def put_many(self, items: Sequence[tuple[Ticket, Episode]]) -> None:
        """Accept a batch of finished episodes under one lock hold, all or none (an invalid ticket or
        policy anywhere rejects the whole batch).

        One hold and one wake-up per batch, not per episode: a trainer woken by the first episode of a
        batch would otherwise lease a fragment of it, and every fragment costs it a round trip. A batch
        that came over the wire (`PackedEpisodes`) is kept in the columns it arrived in.
        """
        packed = PackedEpisodes.pack(items)
        chunks, used, episodes = columns.split(packed)
        for name in chunks:
            self._policy(name)
        with self._cond:
            if self._cancelled:
                # Tickets were voided by cancel; the episodes still finished, so count their drops.
                for ticket_id in packed.ticket_ids:
                    self._tickets.pop(ticket_id, None)
                for name, c in chunks.items():
                    self._p[name].produced += len(c)
                    self._p[name].dropped[DropReason.JOB_CANCELLED] += len(c)
                return
            seen: set[int] = set()
            for ticket_id, head, policies in zip(packed.ticket_ids, packed.heads, used, strict=True):
                t = self._tickets.get(ticket_id)
                if t is None or ticket_id in seen:
                    raise UnknownTicketError(f"ticket {ticket_id} is not outstanding")
                seen.add(ticket_id)
                extra = policies - t.policies
                if extra:
                    raise ValueError(f"episode {head[0]} involves policies without credit: {sorted(extra)}")
            for ticket_id, policies in zip(packed.ticket_ids, used, strict=True):
                for n in self._tickets.pop(ticket_id).policies - policies:
                    self._p[n].admitted -= 1  # credit back: this episode never used that policy
            self._accept(chunks.values(), episodes, packed.heads)
            self._cond.notify_all()

    def _accept(
        self, chunks: Iterable[Chunk], episodes: columns.Counts, heads: Sequence[EpisodeHead]
    ) -> None:
        kept = []
        for c in chunks:
            p = self._p[c.policy]
            p.produced += len(c)
            if p.finished or p.restarting:
                reason = (
                    DropReason.POLICY_FROZEN
                    if p.cfg.frozen
                    else DropReason.POLICY_FINISHED
                    if p.finished
                    else DropReason.POLICY_RESTARTING
                )
                p.dropped[reason] += len(c)
                p.admitted -= len(c.pair_episode)  # nothing of these episodes will be consumed
            else:
                kept.append(c)
                episodes += np.bincount(c.row_episode, minlength=len(episodes))  # in place: chunks share it
        self._live_episodes += int(np.count_nonzero(episodes))
        # Only once the whole put is counted as live may a sample settle (a stale drop): settling
        # the first of a pair's samples early would close the pair under the others.
        for c in kept:
            p = self._p[c.policy]
            for _, i, j in self._drop_skewed(p, c, self._drop_filtered(p, c, heads)):
                if p.version - c.oldest <= p.cfg.max_staleness:
                    p.queue.append((c, i, j))
                    p.buffered += j - i
                else:
                    fresh = self._drop_stale(p, c, i, j)
                    p.queue += fresh
                    p.buffered += sum(b - a for _, a, b in fresh)

    # -- consumers ---------------------------------------------------------------------------

    def pull(self, policy: str, consumer: str, max_samples: int, timeout: float | None = 0.0) -> Lease | None:
        """Lease up to `max_samples` of `policy`'s oldest samples to `consumer`; None if none came in time."""
        if max_samples < 1:
            raise ValueError("max_samples must be >= 1")
        p = self._policy(policy)
        with self._cond:
            if (
                not self.wait(lambda: p.buffered > 0 or p.finished or self._cancelled, timeout)
                or not p.buffered
            ):
                return None
            n = left = min(max_samples, p.buffered)
            taken: list[Segment] = []
            while left:
                c, i, j = p.queue[0]
                if j - i <= left:
                    taken.append(p.queue.popleft())
                    left -= j - i
                else:
                    taken.append((c, i, i + left))
                    p.queue[0] = (c, i + left, j)
                    left = 0
            p.buffered -= n
            lease_id = self._take_id()
            self._leases[lease_id] = LeaseState(policy, consumer, taken, n)
        # The batch needs no lock (token columns are immutable): producers and the other policies'
        # trainers are not held up by it.
        return Lease(lease_id, policy, consumer, columns.lease_batch(policy, taken))

    def ack(self, lease_id: int) -> None:
        """The lease's samples were trained on (after the optimizer step): they are consumed."""
        with self._cond:
            lease = self._pop_lease(lease_id)
            p = self._p[lease.policy]
            for c, i, j in lease.segments:
                total, worst = columns.lags(c, i, j, p.version)
                p.staleness_sum += total
                p.staleness_max = max(p.staleness_max, worst)
                self._settle(c, slice(i, j), consumed=True)
            p.consumed += lease.n
            self._cond.notify_all()

    def nack(self, lease_id: int) -> None:
        """Give a lease back untrained: its samples are redelivered before anything newer."""
        with self._cond:
            self._requeue(self._pop_lease(lease_id))
            self._cond.notify_all()

    def consumer_failed(self, consumer: str) -> int:
        """A trainer died: redeliver every sample it held but had not acknowledged. Returns the count."""
        with self._cond:
            ids = sorted((i for i, ls in self._leases.items() if ls.consumer == consumer), reverse=True)
            n = 0
            # Newest lease first, each pushed to the front: the oldest ends up first again.
            for i in ids:
                lease = self._leases.pop(i)
                n += lease.n
                self._requeue(lease)
            self._cond.notify_all()
            return n

    def advance(self, policy: str, version: int) -> int:
        """The trainer reached `version`: more credit; buffered samples now too stale are dropped."""
        p = self._policy(policy)
        with self._cond:
            if version < p.version:
                raise ValueError(f"{policy}: version {version} < current {p.version}")
            newer, p.version = version > p.version, version
            if newer:
                p.zero_variance_dropped = 0
            before = p.buffered
            keep: deque[Segment] = deque()
            for c, i, j in p.queue:
                if version - c.oldest <= p.cfg.max_staleness:
                    keep.append((c, i, j))
                else:
                    keep += self._drop_stale(p, c, i, j)
            p.queue = keep
            p.buffered = sum(j - i for _, i, j in keep)
            if newer and p.cfg.max_staleness == 0:  # after the drops: their credit went back
                p.base = p.admitted - self._pairs_ahead(policy)
            self._cond.notify_all()
            return before - p.buffered

    def pause(self, policy: str) -> None:
        """The policy's trainer restarts alone: until `restart`, it holds no episode back (no credit
        taken) and the samples that arrive for it are dropped (`DropReason.POLICY_RESTARTING`)."""
        p = self._policy(policy)
        with self._cond:
            p.restarting = True
            self._cond.notify_all()

    def restart(self, policy: str, version: int, final_version: int | None) -> int:
        """The policy's trainer restarted from a checkpoint and publishes `version` next, past every
        version its engines served (versions stay monotone, so a token's version still names the
        weights that sampled it); its training now ends at `final_version`. The credit follows
        from the new version as from any other (`advance`); returns the samples dropped as stale."""
        p = self._policy(policy)
        with self._cond:
            p.cfg = replace(p.cfg, final_version=final_version)
            p.restarting = False
        return self.advance(policy, version)

    # -- ends --------------------------------------------------------------------------------

    def finish(self, policy: str) -> None:
        """The policy's training is over: its buffered samples (and any that arrive later) are dropped."""
        p = self._policy(policy)
        with self._cond:
            p.finished = True
            self._drop_queue(p, DropReason.POLICY_FINISHED)
            self._cond.notify_all()

    def reopen(self, policy: str) -> None:
        """A finished policy trains again (a job resumed with more steps): it takes credit again.

        Its accounts stayed exact while it was finished (tickets, drops and late arrivals all settled
        their credit), so the credit it gets is what its version allows minus what its consumed and
        still buffered episodes hold."""
        p = self._policy(policy)
        if p.cfg.frozen:
            raise ValueError(f"policy {policy} is frozen (trainer: null): it is never trained")
        with self._cond:
            p.finished = False
            self._cond.notify_all()

    def cancel(self) -> None:
        """The job is cancelled: everything not yet consumed is dropped; leases and tickets are void."""
        with self._cond:
            self._cancelled = True
            for lease in self._leases.values():
                for c, i, j in lease.segments:
                    self._drop(self._p[lease.policy], c, slice(i, j), j - i, DropReason.JOB_CANCELLED)
            self._leases.clear()
            for p in self._p.values():
                self._drop_queue(p, DropReason.JOB_CANCELLED)
            self._tickets.clear()
            self._cond.notify_all()

    # -- state -------------------------------------------------------------------------------

    @property
    def policies(self) -> list[str]:
        return list(self._p)

    def versions(self) -> dict[str, int]:
        """Each policy's trainer version (what `stats` reports, without the counting)."""
        with self._cond:
            return {name: p.version for name, p in self._p.items()}

    def stats(self, policy: str) -> PolicyStats:
        p = self._policy(policy)
        with self._cond:
            return p.stats(
                sum(ls.n for ls in self._leases.values() if ls.policy == policy),
                sum(1 for t in self._tickets.values() if policy in t.policies),
            )

    def wait_buffered(self, policy: str, n: int, timeout: float | None) -> bool:
        """Wait (up to `timeout`) until `policy` has at least `n` samples buffered."""
        p = self._policy(policy)
        with self._cond:
            return self.wait(lambda: p.buffered >= n or self._cancelled, timeout)

    def wait_version_in(self, policy: str, timeout: float | None) -> bool:
        """Sync mode: wait (up to `timeout`) until every episode of `policy`'s current version is in:
        samples buffered, its credit used up, no ticket naming it out."""
        p = self._policy(policy)

        def ready() -> bool:
            if self._cancelled:
                return True
            out = any(policy in t.policies for t in self._tickets.values())
            return p.buffered > 0 and p.credit() <= 0 and not out

        with self._cond:
            return self.wait(ready, timeout)

    def snapshot(self) -> BufferSnapshot:
        """State for a checkpoint (snapshots.py): leased samples count as unconsumed."""
        with self._cond:
            return take_snapshot(
                self._p, self._leases, self._tickets.values(), self.capacity_episodes, self._cancelled
            )

    @classmethod
    def restore(
        cls,
        snap: BufferSnapshot,
        policies: Sequence[PolicyConfig] | None = None,
        capacity_episodes: int | None = None,
    ) -> ExperienceBuffer:
        """The buffer a snapshot describes, under the job's current `policies` and capacity when given
        (a resumed job may have changed its staleness, episodes per step or policies): a new policy
        starts empty; one the job no longer has is finished, so its samples are dropped and counted."""
        configs = list(policies) if policies is not None else list(snap.configs)
        names = {c.name for c in configs}
        gone = [c for c in snap.configs if c.name not in names]
        buf = cls([*configs, *gone], capacity_episodes or snap.capacity_episodes)
        for name, state in snap.policies.items():
            p = buf._p[name]
            for key, value in state.items():
                setattr(p, key, dict(value) if isinstance(value, dict) else value)
            p.dropped = {r.value: 0 for r in DropReason} | p.dropped  # reasons newer than the snapshot
            p.finished = p.finished or p.cfg.frozen  # frozen in the resumed job's spec
        chunks, episodes = columns.restored(snap.samples, {k: v[1] for k, v in snap.pairs.items()})
        for name, chunk in chunks.items():
            buf._p[name].queue.append((chunk, 0, len(chunk)))
            buf._p[name].buffered = len(chunk)
        buf._live_episodes = int(np.count_nonzero(episodes))
        buf._cancelled = snap.cancelled
        before = {c.name: c.max_staleness for c in snap.configs}
        for c in configs:
            # A checkpoint without the sync version's base, or one from an async run: what is
            # buffered is all the current version's once the stale samples are dropped (below).
            if "base" not in snap.policies.get(c.name, {}) or before.get(c.name) != c.max_staleness:
                buf._p[c.name].base = buf._p[c.name].admitted - buf._pairs_ahead(c.name)
        for c in gone:
            buf.finish(c.name)
        for c in configs:  # a changed maxStaleness applies to what is buffered at once
            if c.name in before and c.max_staleness != before[c.name]:
                buf.advance(c.name, buf._p[c.name].version)
        return buf
