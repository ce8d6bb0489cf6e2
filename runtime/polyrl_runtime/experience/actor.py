"""The experience buffer as a Ray actor (local mode and pods): the coordinator owns it.

A threaded actor, so a trainer blocked in `pull` (or a workflow in `acquire`) does not stop others
from putting, acking or advancing. Calls take lists, so a workflow worker sends a batch of episodes in
one call and per-call overhead does not bound throughput.
"""

from __future__ import annotations

from collections.abc import Sequence

from ray.actor import ActorHandle

from polyrl_runtime.actors import start_actor
from polyrl_runtime.experience.buffer import (
    BufferSnapshot,
    ExperienceBuffer,
    Lease,
    PolicyConfig,
    PolicyStats,
)
from polyrl_runtime.experience.types import Episode, Ticket
from polyrl_runtime.experience.wire import TicketBatch


class ExperienceService:
    """Ray-facing wrapper around one job's `ExperienceBuffer` (also usable directly in-process)."""

    def __init__(
        self,
        policies: Sequence[PolicyConfig],
        capacity_episodes: int,
        snapshot: BufferSnapshot | None = None,
    ) -> None:
        self.buffer = (
            ExperienceBuffer.restore(snapshot, policies, capacity_episodes)
            if snapshot is not None
            else ExperienceBuffer(policies, capacity_episodes)
        )

    def acquire(
        self, policies: Sequence[str], n: int = 1, timeout: float | None = 0.0, group: int = 1
    ) -> list[Ticket]:
        """Up to `n` tickets in whole groups of `group`; waits (up to `timeout`) only for the first."""
        return TicketBatch(self.buffer.acquire_many(policies, n, timeout, group=group))

    def release(self, tickets: Sequence[Ticket]) -> None:
        for t in tickets:
            self.buffer.release(t)

    def put(self, items: Sequence[tuple[Ticket, Episode]]) -> None:
        """Put a batch of finished episodes, all or none (callers send an `EpisodeBatch`: see wire.py)."""
        self.buffer.put_many(items)

    def pull(
        self,
        policy: str,
        consumer: str,
        max_samples: int,
        timeout: float | None = 0.0,
        *,
        ack: Sequence[int] = (),
        version: int | None = None,
    ) -> Lease | None:
        """Ack the previous step's leases, record the trainer's new version, then lease the next batch.

        One call per trainer step: round trips, not bytes, are what a remote buffer costs.
        """
        for i in ack:
            self.buffer.ack(i)
        if version is not None:
            self.buffer.advance(policy, version)
        return self.buffer.pull(policy, consumer, max_samples, timeout)

    def exchange(
        self,
        items: Sequence[tuple[Ticket, Episode]],
        policies: Sequence[str],
        n: int,
        timeout: float | None = 0.0,
    ) -> tuple[list[Ticket], dict[str, int]]:
        """A workflow worker's one call per batch: put finished episodes, take credit for the next ones,
        and learn each policy's current version (which its engines should be serving)."""
        self.put(items)
        tickets = self.acquire(policies, n, timeout) if n > 0 else TicketBatch()
        return tickets, self.versions()

    def ack(self, lease_ids: Sequence[int]) -> None:
        for i in lease_ids:
            self.buffer.ack(i)

    def nack(self, lease_ids: Sequence[int]) -> None:
        for i in lease_ids:
            self.buffer.nack(i)

    def consumer_failed(self, consumer: str) -> int:
        return self.buffer.consumer_failed(consumer)

    def advance(self, policy: str, version: int) -> int:
        return self.buffer.advance(policy, version)

    def pause(self, policy: str) -> None:
        self.buffer.pause(policy)

    def restart(self, policy: str, version: int, final_version: int | None) -> int:
        return self.buffer.restart(policy, version, final_version)

    def finish(self, policy: str) -> None:
        self.buffer.finish(policy)

    def reopen(self, policy: str) -> None:
        self.buffer.reopen(policy)

    def cancel(self) -> None:
        self.buffer.cancel()

    def versions(self) -> dict[str, int]:
        """Each policy's trainer version: what a workflow stamps on the tokens it generates next."""
        return self.buffer.versions()

    def stats(
        self, wait_for: tuple[str, int] | None = None, timeout: float = 0.0, *, whole_version: bool = False
    ) -> dict[str, PolicyStats]:
        """Every policy's stats; with `wait_for` (policy, n), first wait up to `timeout` for n samples
        of that policy to be buffered, or with `whole_version` (sync mode) for every episode of its
        current version to be in (one long poll instead of many short ones)."""
        if wait_for is not None:
            if whole_version:
                self.buffer.wait_version_in(wait_for[0], timeout)
            else:
                self.buffer.wait_buffered(*wait_for, timeout)
        return {p: self.buffer.stats(p) for p in self.buffer.policies}

    def snapshot(self) -> BufferSnapshot:
        return self.buffer.snapshot()

    def resident_episodes(self) -> int:
        return self.buffer.resident_episodes


def create_experience_actor(
    policies: Sequence[PolicyConfig],
    capacity_episodes: int,
    *,
    snapshot: BufferSnapshot | None = None,
    name: str | None = None,
    max_concurrency: int = 16,
    **options: object,
) -> ActorHandle[ExperienceService]:
    """Start the buffer actor (restored from `snapshot` if given); returns its handle (the job
    calls it through `experience.client.BufferClient`)."""
    opts: dict[str, object] = {"max_concurrency": max_concurrency, "num_cpus": 0, **options}
    if name is not None:
        opts["name"] = name
    return start_actor(ExperienceService, opts, policies, capacity_episodes, snapshot)
