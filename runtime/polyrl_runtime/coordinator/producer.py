"""The driver's producing side: keeps the workflow workers busy with episode groups, as far as the
buffer's staleness credit allows, and accounts for every episode they report.

Kept apart from the driver's training side: they meet only in the buffer (credit, samples) and in
`ProducerEvents.episode`, which feeds each policy's reward window.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import ray
import structlog

from polyrl_runtime.actors import Actor, actor_gone
from polyrl_runtime.coordinator.datafeed import DataFeed
from polyrl_runtime.coordinator.failures import fail_on_error
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.slots import Slot, WorkerSlot
from polyrl_runtime.experience.buffer import UnknownTicketError
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.experience.wire import TicketBatch
from polyrl_runtime.workflows.opponents import OpponentRecord
from polyrl_runtime.workflows.runner import EpisodeGroup, GroupReport

log = structlog.get_logger(__name__)


class ProducerEvents(Protocol):
    """What the producer reports to the job, as one object (coordinator/training.py implements it)."""

    def still_training(self, policy: str) -> bool: ...

    def episode(
        self, policy: str, reward: float, success: float | None, samples: int, skew: Mapping[str, int]
    ) -> None:
        """A finished episode: the policy's agents' reward, its success metric if any, its samples,
        and how many versions the policy was apart from each other policy of the episode."""

    def opponents(
        self, asked: frozenset[str], played: Mapping[str, OpponentRecord], versions: Mapping[str, int]
    ) -> None:
        """A finished episode's league: the policies an opponent was asked of, the snapshots played,
        the episode's version vector."""

    def fail(self, message: str, retryable: bool) -> None: ...

    def emit(self, kind: str, **data: Any) -> None: ...

    def lost(self, slots: Sequence[Slot[Actor]]) -> None:
        """Engines and workers this producer saw die first (reported once each)."""


@dataclass(frozen=True)
class ProducerLimits:
    max_in_flight_per_worker: int
    groups_per_call: int  # episode groups a worker gets per Ray call (a call costs ~1 ms of CPU)
    max_consecutive_failures: int
    unused_episodes: int  # episodes in a row without a turn of a policy before the job fails


class EpisodeProducer:
    def __init__(
        self,
        *,
        buffer: BufferClient,
        fleet: Fleet,
        policies: list[str],
        group_size: int,
        seed: int,
        entrypoint: str,
        limits: ProducerLimits,
        events: ProducerEvents,
        signals: int,
        feed: DataFeed | None = None,
    ) -> None:
        if limits.max_in_flight_per_worker < group_size:
            raise ValueError(
                f"max_in_flight_per_worker ({limits.max_in_flight_per_worker}) must hold a whole group "
                f"({group_size} episodes)"
            )
        self.buffer, self.fleet, self.policies, self.group_size = buffer, fleet, policies, group_size
        self.seed, self.entrypoint, self.limits = seed, entrypoint, limits
        self._still_training = events.still_training
        self._on_episode = events.episode
        self._on_opponents = events.opponents
        self._fail = events.fail
        self._emit = events.emit
        self._lost = events.lost
        self.failures: Counter[str] = Counter()
        self.episodes_ok = 0
        self.in_flight = 0  # episodes dispatched and not yet reported
        self.group_seq = 0
        self.signals: deque[float] = deque(maxlen=signals)  # recent rewards (global advantage norm)
        self._rng = random.Random(seed)
        self._consecutive_failures = 0
        self._unused = dict.fromkeys(policies, 0)  # episodes in a row without a turn of the policy
        self.feed = feed  # the data row each group plays (None: the job has no spec.data)

    # -- checkpoints -----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        data = {"data": self.feed.state()} if self.feed is not None else {}
        return {
            "group_seq": self.group_seq,
            "episodes_ok": self.episodes_ok,
            "failures": dict(self.failures),
            **data,
        }

    def restore(self, state: dict[str, Any], buffered: frozenset[str] = frozenset()) -> None:
        """Continue from a checkpoint's counters; `buffered`: the groups with samples in its buffer
        snapshot (their data rows are not played again)."""
        if self.feed is not None and "data" in state:
            self.feed.restore(state["data"], buffered)
        self.group_seq = int(state.get("group_seq", 0))
        self.episodes_ok = int(state.get("episodes_ok", 0))
        self.failures.update(state.get("failures", {}))
        # Resumed runs draw new seeds, not the first run's again.
        self._rng.seed(self.seed + self.group_seq)

    @property
    def data_finished(self) -> bool:
        """The train data is exhausted and every group of it accounted for: no more episodes come."""
        return self.feed is not None and self.feed.finished

    def data_end_message(self, steps: dict[str, int]) -> str | None:
        """Why the job ended early when the train data ran out before totalSteps (else None)."""
        return self.feed.end_message(steps) if self.feed is not None and self.feed.finished else None

    # -- dispatch --------------------------------------------------------------------------------

    def _pick_worker(self) -> WorkerSlot | None:
        ok = [w for w in self.fleet.workers.values() if not w.dead and not w.draining]
        ok = [w for w in ok if w.in_flight + self.group_size <= self.limits.max_in_flight_per_worker]
        return min(ok, key=lambda w: w.in_flight) if ok else None

    async def run(self, stop: asyncio.Event) -> None:
        pending: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            worker = self._pick_worker()
            if worker is None or (self.feed is not None and self.feed.exhausted):
                await asyncio.sleep(0.05)
                continue
            room = self.limits.max_in_flight_per_worker - worker.in_flight
            want = min(self.limits.groups_per_call, room // self.group_size) * self.group_size
            tickets = await self.buffer.acquire(self.policies, want, 0.2, self.group_size)
            if not tickets:
                continue
            groups: list[EpisodeGroup] = []
            for i in range(0, len(tickets), self.group_size):
                gid = f"g{self.group_seq}"
                row = self.feed.take(gid) if self.feed is not None else None
                if self.feed is not None and row is None:  # the data ran out: no group without a row
                    await self.buffer.release(tickets[i:])
                    break
                groups.append(
                    (gid, self._rng.randrange(2**31), TicketBatch(tickets[i : i + self.group_size]), row)
                )
                self.group_seq += 1
            if not groups:
                continue
            tickets = [t for _, _, batch, _ in groups for t in batch]
            worker.in_flight += len(tickets)
            self.in_flight += len(tickets)
            task = asyncio.create_task(self._run_groups(worker, groups))
            pending.add(task)
            task.add_done_callback(pending.discard)
            # a bug in the accounting of a call's results: its samples would be neither trained on
            # nor counted as dropped
            fail_on_error(
                task, "episode producer: handling a worker's results", lambda m: self._fail(m, True)
            )
        for t in pending:
            t.cancel()

    async def _run_groups(self, worker: WorkerSlot, groups: Sequence[EpisodeGroup]) -> None:
        n = sum(len(t) for _, _, t, _ in groups)
        try:
            await self._account(worker, groups)
        finally:
            # Counted in flight until accounted for: once `in_flight` is 0, every episode dispatched
            # so far is in the reward windows (a sync step's metrics cover exactly its episodes).
            self.in_flight -= n

    async def _account(self, worker: WorkerSlot, groups: Sequence[EpisodeGroup]) -> None:
        n = sum(len(t) for _, _, t, _ in groups)
        try:
            results = await worker.actor.run_groups(groups)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if actor_gone(e) and self.fleet.mark_worker_dead(worker):
                self._lost([worker])
            results = [str(e).splitlines()[0]] * len(groups)
        finally:
            worker.in_flight = max(0, worker.in_flight - n)
        for (gid, _, tickets, _), result in zip(groups, results, strict=True):
            if isinstance(result, GroupReport):
                if self.feed is not None:
                    self.feed.settle(gid)
                self.handle_report(result)
                continue
            if self.feed is not None:  # the group did not run: its row is played by the next one
                self.feed.give_back(gid)
            for t in tickets:  # those the worker had not put yet
                with contextlib.suppress(UnknownTicketError, ray.exceptions.RayTaskError):
                    await self.buffer.release([t])
            self.failures["worker_error"] += len(tickets)
            log.warning("group.failed", group=gid, worker=worker.name, error=result)

    # -- accounting ------------------------------------------------------------------------------

    def handle_report(self, report: GroupReport) -> None:
        for ep in report.episodes:
            if not ep.ok:
                self.failures[ep.reason] += 1
                self._consecutive_failures += 1
                log.warning("episode.failed", episode=ep.episode_id, reason=ep.reason, error=ep.error)
                self._emit("episode_failed", episode=ep.episode_id, reason=ep.reason, error=ep.error)
                if self._consecutive_failures >= self.limits.max_consecutive_failures:
                    self._fail(
                        f"{self._consecutive_failures} episodes in a row failed; last: episode "
                        f"{ep.episode_id} ({ep.reason}): {ep.error}",
                        ep.reason not in ("workflow_error", "reward_error"),
                    )
                if not ep.penalised:
                    continue
            else:
                self._consecutive_failures = 0
            if ep.replaced_snapshot is not None:  # played again: its first draw's snapshot was gone
                self.failures["snapshot_replaced"] += 1
            self.episodes_ok += 1
            self._check_used(ep.samples)
            self._on_opponents(ep.opponent_policies, ep.opponents, ep.versions)
            success = ep.metadata.get("success")
            for policy, reward in ep.policy_rewards.items():
                mine = ep.versions.get(policy)
                skew = (
                    {o: abs(v - mine) for o, v in ep.versions.items() if o != policy}
                    if mine is not None
                    else {}
                )
                self._on_episode(
                    policy,
                    reward,
                    float(success) if isinstance(success, int | float) else None,
                    ep.samples[policy],
                    skew,
                )
            self.signals.extend(ep.rewards.values())
        if report.dead_engines:
            self._lost(self.fleet.mark_dead(report.dead_engines))

    def _check_used(self, samples: dict[str, int]) -> None:
        """A policy the workflow never calls would wait for samples forever: after `unused_episodes`
        episodes in a row without a turn of it (while it still has steps to train), fail the job."""
        for name in self.policies:
            self._unused[name] = 0 if samples.get(name) else self._unused[name] + 1
            if self._unused[name] >= self.limits.unused_episodes and self._still_training(name):
                self._fail(
                    f"policy {name}: no agent turn of it in the last {self._unused[name]} episodes of "
                    f"workflow {self.entrypoint} (does the workflow call an agent of this policy?)",
                    False,
                )
