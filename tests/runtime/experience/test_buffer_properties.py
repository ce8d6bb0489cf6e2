"""Hypothesis state machine: any interleaving of produce, consume, ack, crash, restart, rollback, finish
and cancel loses nothing, redelivers nothing acknowledged, never exceeds the staleness credit or the
memory bound, and counts every drop. The model below is the specification, kept independent of the
buffer's own bookkeeping (it counts credit from tickets and sample fates, not from buffer fields).
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from polyrl_runtime.experience import (
    DropReason,
    Episode,
    ExperienceBuffer,
    PolicyConfig,
    Ticket,
    Turn,
    UnknownLeaseError,
    UnknownTicketError,
)
from polyrl_runtime.experience.wire import EpisodeBatch

POLICIES = ("a", "b")
CONSUMERS = ("t0", "t1")


@dataclass
class Model:
    version: dict[str, int]
    queue: dict[str, list[str]] = field(default_factory=lambda: {p: [] for p in POLICIES})
    leases: dict[int, tuple[str, str, list[str]]] = field(default_factory=dict)  # id -> policy, consumer, ids
    tickets: dict[int, frozenset[str]] = field(default_factory=dict)
    fate: dict[str, str] = field(default_factory=dict)  # sample id -> live | consumed | drop reason
    policy_of: dict[str, str] = field(default_factory=dict)
    min_version: dict[str, int] = field(default_factory=dict)
    pairs: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (episode, policy) -> sample ids
    finished: set[str] = field(default_factory=set)
    cancelled: bool = False
    episodes: int = 0
    # Sync: the pairs of earlier versions, as of the policy's latest version change.
    base: dict[str, int] = field(default_factory=lambda: {p: 0 for p in POLICIES})
    carried: dict[str, int] = field(default_factory=lambda: {p: 0 for p in POLICIES})  # tickets out then

    def live_pairs(self, policy: str) -> int:
        """(episode, policy) pairs that still hold credit: some sample live, or some consumed."""
        return sum(
            1
            for (_, p), ids in self.pairs.items()
            if p == policy and any(self.fate[i] in ("live", "consumed") for i in ids)
        )

    def queued_pairs(self, policy: str) -> int:
        """(episode, policy) pairs with a sample buffered (not leased)."""
        return len({sid.split("/")[0] for sid in self.queue[policy]})

    def admitted(self, policy: str) -> int:
        return sum(1 for ps in self.tickets.values() if policy in ps) + self.live_pairs(policy)

    def resident(self) -> int:
        live_eps = {i.split("/")[0] for i, f in self.fate.items() if f == "live"}
        return len(self.tickets) + len(live_eps)


class BufferMachine(RuleBasedStateMachine):
    @initialize(
        per_version=st.integers(1, 3),
        staleness=st.integers(0, 2),
        capacity=st.integers(1, 6),
        final=st.one_of(st.none(), st.integers(1, 4)),
    )
    def setup(self, per_version: int, staleness: int, capacity: int, final: int | None) -> None:
        self.cfgs = [PolicyConfig(p, per_version, staleness, final_version=final) for p in POLICIES]
        self.capacity = capacity
        self.buf = ExperienceBuffer(self.cfgs, capacity)
        self.model = Model(version={p: 0 for p in POLICIES})
        self.issued: dict[int, Ticket] = {}
        self.saved: tuple[bytes, Model, list[PolicyConfig]] | None = None

    def _sync_done(self, p: str) -> bool:
        c = self.cfgs[POLICIES.index(p)]
        return (
            c.max_staleness == 0 and c.final_version is not None and self.model.version[p] >= c.final_version
        )

    def _limit(self, p: str) -> int:
        c = self.cfgs[POLICIES.index(p)]
        if c.max_staleness == 0:  # sync: one version's episodes on top of the earlier versions'
            return self.model.base[p] + (0 if self._sync_done(p) else c.episodes_per_version)
        versions = self.model.version[p] + c.max_staleness + 1
        if c.final_version is not None:
            versions = min(versions, c.final_version)
        return versions * c.episodes_per_version

    # -- producers ---------------------------------------------------------------------------

    def _can_admit(self, which: tuple[str, ...]) -> bool:
        m = self.model
        return (
            not m.cancelled
            and m.resident() < self.capacity
            and any(p not in m.finished for p in which)
            and all(p in m.finished or m.admitted(p) < self._limit(p) for p in which)
        )

    def _issued(self, ticket: Ticket, which: tuple[str, ...]) -> None:
        self.model.tickets[ticket.ticket_id] = frozenset(p for p in which if p not in self.model.finished)
        self.issued[ticket.ticket_id] = ticket

    @rule(which=st.sampled_from([("a",), ("b",), ("a", "b")]))
    def acquire(self, which: tuple[str, ...]) -> None:
        can = self._can_admit(which)
        ticket = self.buf.acquire(which)
        assert (ticket is not None) == can, (which, can)
        if ticket is not None:
            self._issued(ticket, which)

    @rule(which=st.sampled_from([("a",), ("b",), ("a", "b")]), n=st.integers(0, 4))
    def acquire_many(self, which: tuple[str, ...], n: int) -> None:
        """A batch of tickets: as many as `acquire` one by one would have given, up to n."""
        tickets = self.buf.acquire_many(which, n)
        expected = 0
        while expected < n and self._can_admit(which):
            expected += 1
            if expected <= len(tickets):
                self._issued(tickets[expected - 1], which)
        assert len(tickets) == expected, (which, n, len(tickets), expected)

    @precondition(lambda self: bool(self.model.tickets))
    @rule(data=st.data())
    def put(self, data: st.DataObject) -> None:
        self._admit(data, [data.draw(st.sampled_from(sorted(self.model.tickets)))], single=True)

    @precondition(lambda self: bool(self.model.tickets))
    @rule(data=st.data())
    def put_many(self, data: st.DataObject) -> None:
        """Several episodes in one call; with a bad ticket among them, none is taken."""
        m = self.model
        tids = data.draw(st.lists(st.sampled_from(sorted(m.tickets)), min_size=1, max_size=3, unique=True))
        if data.draw(st.booleans()):
            built = [self._episode(data, tid) for tid in tids]
            bad = Ticket(10_000 + m.episodes, frozenset({"a"}))
            with pytest.raises(UnknownTicketError):
                self.buf.put_many([*built, (bad, built[0][1])])
            return
        self._admit(data, tids)

    def _episode(self, data: st.DataObject, tid: int) -> tuple[Ticket, Episode]:
        m = self.model
        ticket = self.issued[tid]
        used = data.draw(st.sets(st.sampled_from(sorted(ticket.policies)), min_size=1))
        m.episodes += 1
        eid = f"e{m.episodes}"
        turns = []
        for p in sorted(used):
            for _ in range(data.draw(st.integers(1, 2))):
                lag = data.draw(st.integers(0, 3))
                v = m.version[p]
                versions = np.array([v, max(0, v - lag)], dtype=np.int32)
                turns.append(Turn(f"agent-{p}", p, [1, 2], [3, 4], [-0.5, -0.1], versions))
        turns = data.draw(st.permutations(turns))  # agents may take turns in any order
        return ticket, Episode(eid, tuple(turns), {f"agent-{p}": 1.0 for p in used})

    def _admit(self, data: st.DataObject, tids: list[int], *, single: bool = False) -> None:
        m = self.model
        built = [self._episode(data, tid) for tid in tids]
        if single:
            self.buf.put(*built[0])
        elif data.draw(st.booleans()):
            self.buf.put_many(built)
        else:  # as a workflow worker's put arrives through Ray: packed, kept in its columns
            self.buf.put_many(pickle.loads(pickle.dumps(EpisodeBatch(built))))
        for tid, (_, episode) in zip(tids, built, strict=True):
            del m.tickets[tid]
            self._model_put(episode)

    def _model_put(self, episode: Episode) -> None:
        m = self.model
        eid = episode.episode_id
        for i, s in enumerate(episode.samples()):
            sid = f"{eid}/{i}"
            m.policy_of[sid] = s.policy
            m.min_version[sid] = s.min_version
            m.pairs.setdefault((eid, s.policy), []).append(sid)
            cfg = self.cfgs[POLICIES.index(s.policy)]
            if s.policy in m.finished:
                m.fate[sid] = DropReason.POLICY_FINISHED
            elif m.version[s.policy] - s.min_version > cfg.max_staleness:
                m.fate[sid] = DropReason.STALE
            else:
                m.fate[sid] = "live"
                m.queue[s.policy].append(sid)

    @precondition(lambda self: bool(self.model.tickets))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.model.tickets)))
        self.buf.release(self.issued[tid])
        del self.model.tickets[tid]

    # -- consumers ---------------------------------------------------------------------------

    @rule(policy=st.sampled_from(POLICIES), consumer=st.sampled_from(CONSUMERS), n=st.integers(1, 4))
    def pull(self, policy: str, consumer: str, n: int) -> None:
        m = self.model
        lease = self.buf.pull(policy, consumer, n)
        expected = m.queue[policy][:n]
        if not expected:
            assert lease is None
            return
        assert lease is not None
        got = list(lease.batch.sample_ids)
        assert got == expected
        for sid in got:
            assert m.fate[sid] == "live", f"{sid} delivered while {m.fate[sid]}"
        for other in m.leases.values():
            assert not set(other[2]) & set(got), "a sample leased twice at once"
        del m.queue[policy][: len(got)]
        m.leases[lease.lease_id] = (policy, consumer, got)

    @precondition(lambda self: bool(self.model.leases))
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        lid = data.draw(st.sampled_from(sorted(self.model.leases)))
        self.buf.ack(lid)
        for sid in self.model.leases.pop(lid)[2]:
            self.model.fate[sid] = "consumed"

    @precondition(lambda self: bool(self.model.leases))
    @rule(data=st.data())
    def nack(self, data: st.DataObject) -> None:
        lid = data.draw(st.sampled_from(sorted(self.model.leases)))
        self.buf.nack(lid)
        self._requeue([lid])

    @rule(consumer=st.sampled_from(CONSUMERS))
    def crash(self, consumer: str) -> None:
        mine = sorted((i for i, ls in self.model.leases.items() if ls[1] == consumer), reverse=True)
        assert self.buf.consumer_failed(consumer) == sum(len(self.model.leases[i][2]) for i in mine)
        self._requeue(mine)

    def _requeue(self, lease_ids: list[int]) -> None:
        m = self.model
        for lid in lease_ids:
            policy, _, ids = m.leases.pop(lid)
            if policy in m.finished:
                for sid in ids:
                    m.fate[sid] = DropReason.POLICY_FINISHED
            else:
                m.queue[policy][:0] = ids

    @rule(lid=st.integers(10_000, 10_010))
    def ack_unknown(self, lid: int) -> None:
        try:
            self.buf.ack(lid)
        except UnknownLeaseError:
            return
        raise AssertionError("acking a lease that was never issued must fail")

    # -- trainer versions, ends, restarts --------------------------------------------------

    @rule(policy=st.sampled_from(POLICIES), step=st.integers(0, 2))
    def advance(self, policy: str, step: int) -> None:
        m = self.model
        m.version[policy] += step
        self.buf.advance(policy, m.version[policy])
        cfg = self.cfgs[POLICIES.index(policy)]
        keep = []
        for sid in m.queue[policy]:
            if m.version[policy] - m.min_version[sid] > cfg.max_staleness:
                m.fate[sid] = DropReason.STALE
            else:
                keep.append(sid)
        m.queue[policy] = keep
        if step:  # what is admitted and not buffered (nor under way) belongs to earlier versions
            m.base[policy] = m.live_pairs(policy) - m.queued_pairs(policy)
            m.carried[policy] = sum(1 for ps in m.tickets.values() if policy in ps)

    @precondition(lambda self: len(self.model.finished) < 1)
    @rule(policy=st.sampled_from(POLICIES))
    def finish(self, policy: str) -> None:
        m = self.model
        self.buf.finish(policy)
        m.finished.add(policy)
        for sid in m.queue[policy]:
            m.fate[sid] = DropReason.POLICY_FINISHED
        m.queue[policy] = []

    @precondition(lambda self: not self.model.cancelled)
    @rule(go=st.integers(0, 9))
    def cancel(self, go: int) -> None:
        if go:  # rare: a cancelled job is mostly inert
            return
        m = self.model
        self.buf.cancel()
        m.cancelled = True
        for sid, f in m.fate.items():
            if f == "live":
                m.fate[sid] = DropReason.JOB_CANCELLED
        m.queue = {p: [] for p in POLICIES}
        m.leases.clear()
        m.tickets.clear()

    def _restored_model(self, m: Model) -> Model:
        m = copy.deepcopy(m)
        for policy in POLICIES:
            leased = [
                sid for lid in sorted(m.leases) if m.leases[lid][0] == policy for sid in m.leases[lid][2]
            ]
            m.queue[policy] = leased + m.queue[policy]
        m.leases.clear()
        m.tickets.clear()  # outstanding tickets die with the restored process
        return m

    @rule()
    def restart(self) -> None:
        """The coordinator restarts from a snapshot taken just now (serialised as a checkpoint would be)."""
        blob = pickle.dumps(self.buf.snapshot())
        self.buf = ExperienceBuffer.restore(pickle.loads(blob))
        self.model = self._restored_model(self.model)

    @precondition(lambda self: bool(self.model.finished) and not self.model.cancelled)
    @rule()
    def resume_with_more_steps(self) -> None:
        """Restart from a snapshot with more steps to train: finished policies take credit again, and
        the job's new step count raises the final version's cap."""
        self.cfgs = [
            replace(c, final_version=None if c.final_version is None else c.final_version + 2)
            for c in self.cfgs
        ]
        blob = pickle.dumps(self.buf.snapshot())
        self.buf = ExperienceBuffer.restore(pickle.loads(blob), self.cfgs)
        self.model = self._restored_model(self.model)
        for policy in sorted(self.model.finished):
            self.buf.reopen(policy)
        self.model.finished.clear()

    @rule()
    def save(self) -> None:
        self.saved = (pickle.dumps(self.buf.snapshot()), self._restored_model(self.model), list(self.cfgs))

    @precondition(lambda self: self.saved is not None)
    @rule()
    def rollback(self) -> None:
        """Resume from an older checkpoint: the state (and what counts as acknowledged) rolls back."""
        assert self.saved is not None
        blob, m, self.cfgs = self.saved
        self.buf = ExperienceBuffer.restore(pickle.loads(blob))
        self.model = copy.deepcopy(m)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def nothing_lost_and_drops_counted(self) -> None:
        m = self.model
        for policy in POLICIES:
            st_ = self.buf.stats(policy)
            fates = [f for sid, f in m.fate.items() if m.policy_of[sid] == policy]
            leased = sum(len(ids) for p, _, ids in m.leases.values() if p == policy)
            assert st_.produced == len(fates)
            assert st_.buffered == len(m.queue[policy])
            assert st_.leased == leased
            assert st_.buffered + st_.leased == fates.count("live")
            assert st_.consumed == fates.count("consumed")
            for reason in DropReason:
                assert st_.dropped[reason.value] == fates.count(reason), reason
            assert st_.produced == st_.buffered + st_.leased + st_.consumed + sum(st_.dropped.values())

    @invariant()
    def credit_and_memory_bounds_hold(self) -> None:
        m = self.model
        for policy in POLICIES:
            if policy not in m.finished and not m.cancelled:
                # A sync version counts the episodes under way at its start as its own; the final
                # version has no room for them (no step trains on them: dropped when it finishes).
                out = m.carried[policy] if self._sync_done(policy) else 0
                assert m.admitted(policy) <= self._limit(policy) + out
                assert self.buf.stats(policy).credit == self._limit(policy) - m.admitted(policy)
        assert m.resident() <= self.capacity
        assert self.buf.resident_episodes == m.resident()


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
