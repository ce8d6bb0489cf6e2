"""The driver's producing side: keeps the workflow workers busy with episode groups, as far as the
buffer's staleness credit allows, and accounts for every episode they report.

Kept apart from the driver's training side: they meet only in the buffer (credit, samples) and in
`on_episode`, which feeds each policy's reward window.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import structlog

from polyrl_runtime.actors import actor_gone
from polyrl_runtime.coordinator.fleet import Fleet, Slot
from polyrl_runtime.coordinator.tasks import fail_on_error
from polyrl_runtime.experience.buffer import UnknownTicketError
from polyrl_runtime.experience.wire import TicketBatch
from polyrl_runtime.workflows.runner import GroupReport

log = structlog.get_logger(__name__)

# (policy, that policy's agents' reward, the episode's success metric if any, its samples of the policy)
EpisodeCallback = Callable[[str, float, float | None, int], None]


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
        buffer: Any,
        fleet: Fleet,
        policies: list[str],
        group_size: int,
        seed: int,
        entrypoint: str,
        limits: ProducerLimits,
        still_training: Callable[[str], bool],
        on_episode: EpisodeCallback,
        fail: Callable[[str, bool], None],
        emit: Callable[..., None],
        lost: Callable[[list[Slot]], None],
        signals: int,
    ) -> None:
        if limits.max_in_flight_per_worker < group_size:
            raise ValueError(
                f"max_in_flight_per_worker ({limits.max_in_flight_per_worker}) must hold a whole group "
                f"({group_size} episodes)"
            )
        self.buffer, self.fleet, self.policies, self.group_size = buffer, fleet, policies, group_size
        self.seed, self.entrypoint, self.limits = seed, entrypoint, limits
        self._still_training = still_training
        self._on_episode = on_episode
        self._fail = fail
        self._emit = emit
        self._lost = lost  # engines and workers this producer saw die first (the driver reports them)
        self.failures: Counter[str] = Counter()
        self.episodes_ok = 0
        self.in_flight = 0  # episodes dispatched and not yet reported
        self.group_seq = 0
        self.signals: deque[float] = deque(maxlen=signals)  # recent rewards (global advantage norm)
        self._rng = random.Random(seed)
        self._consecutive_failures = 0
        self._unused = dict.fromkeys(policies, 0)  # episodes in a row without a turn of the policy

    # -- checkpoints -----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"group_seq": self.group_seq, "episodes_ok": self.episodes_ok, "failures": dict(self.failures)}

    def restore(self, state: dict[str, Any]) -> None:
        self.group_seq = int(state.get("group_seq", 0))
        self.episodes_ok = int(state.get("episodes_ok", 0))
        self.failures.update(state.get("failures", {}))
        # Resumed runs draw new seeds, not the first run's again.
        self._rng.seed(self.seed + self.group_seq)

    # -- dispatch --------------------------------------------------------------------------------

    def _pick_worker(self) -> Slot | None:
        ok = [w for w in self.fleet.workers.values() if not w.dead and not w.draining]
        ok = [w for w in ok if w.in_flight + self.group_size <= self.limits.max_in_flight_per_worker]
        return min(ok, key=lambda w: w.in_flight) if ok else None

    async def run(self, stop: asyncio.Event) -> None:
        pending: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            worker = self._pick_worker()
            if worker is None:
                await asyncio.sleep(0.05)
                continue
            room = self.limits.max_in_flight_per_worker - worker.in_flight
            want = min(self.limits.groups_per_call, room // self.group_size) * self.group_size
            tickets = await self.buffer.acquire.remote(self.policies, want, 0.2, self.group_size)
            if not tickets:
                continue
            groups = []
            for i in range(0, len(tickets), self.group_size):
                groups.append(
                    (
                        f"g{self.group_seq}",
                        self._rng.randrange(2**31),
                        TicketBatch(tickets[i : i + self.group_size]),
                    )
                )
                self.group_seq += 1
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

    async def _run_groups(self, worker: Slot, groups: Sequence[tuple[str, int, Sequence[Any]]]) -> None:
        n = sum(len(t) for _, _, t in groups)
        try:
            await self._account(worker, groups)
        finally:
            # Counted in flight until accounted for: once `in_flight` is 0, every episode dispatched
            # so far is in the reward windows (a sync step's metrics cover exactly its episodes).
            self.in_flight -= n

    async def _account(self, worker: Slot, groups: Sequence[tuple[str, int, Sequence[Any]]]) -> None:
        n = sum(len(t) for _, _, t in groups)
        try:
            results: list[GroupReport | str] = await worker.handle.run_groups.remote(groups)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if actor_gone(e) and self.fleet.mark_worker_dead(worker):
                self._lost([worker])
            results = [str(e).splitlines()[0]] * len(groups)
        finally:
            worker.in_flight = max(0, worker.in_flight - n)
        for (gid, _, tickets), result in zip(groups, results, strict=True):
            if isinstance(result, GroupReport):
                self.handle_report(result)
                continue
            for t in tickets:  # those the worker had not put yet
                with contextlib.suppress(UnknownTicketError, ray.exceptions.RayTaskError):
                    await self.buffer.release.remote([t])
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
                        ep.reason != "workflow_error",
                    )
                continue
            self._consecutive_failures = 0
            self.episodes_ok += 1
            self._check_used(ep.samples)
            success = ep.metadata.get("success")
            for policy, reward in ep.policy_rewards.items():
                self._on_episode(
                    policy,
                    reward,
                    float(success) if isinstance(success, int | float) else None,
                    ep.samples[policy],
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
