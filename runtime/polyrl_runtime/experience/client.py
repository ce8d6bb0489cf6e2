"""The experience buffer actor's client: one method per remote method the job calls, each returning
the call's `ObjectRef` (see polyrl_runtime/actors.py). The driver, the trainer ranks and the workflow
workers all hold one; it pickles with its handle, so it is passed to other actors as it is."""

from __future__ import annotations

from collections.abc import Sequence

import ray

from polyrl_runtime.actors import ActorClient, call
from polyrl_runtime.experience.actor import ExperienceService
from polyrl_runtime.experience.buffer import BufferSnapshot, Lease, PolicyStats
from polyrl_runtime.experience.types import Episode, Ticket


class BufferClient(ActorClient[ExperienceService]):
    """Calls to one job's `ExperienceService` actor (its methods document what each does)."""

    def acquire(
        self, policies: Sequence[str], n: int = 1, timeout: float | None = 0.0, group: int = 1
    ) -> ray.ObjectRef[list[Ticket]]:
        return call(self.handle, ExperienceService.acquire, policies, n, timeout, group)

    def release(self, tickets: Sequence[Ticket]) -> ray.ObjectRef[None]:
        return call(self.handle, ExperienceService.release, tickets)

    def put(self, items: Sequence[tuple[Ticket, Episode]]) -> ray.ObjectRef[None]:
        return call(self.handle, ExperienceService.put, items)

    def pull(
        self, policy: str, consumer: str, max_samples: int, timeout: float | None = 0.0
    ) -> ray.ObjectRef[Lease | None]:
        return call(self.handle, ExperienceService.pull, policy, consumer, max_samples, timeout)

    def ack(self, lease_ids: Sequence[int]) -> ray.ObjectRef[None]:
        return call(self.handle, ExperienceService.ack, lease_ids)

    def consumer_failed(self, consumer: str) -> ray.ObjectRef[int]:
        return call(self.handle, ExperienceService.consumer_failed, consumer)

    def advance(self, policy: str, version: int) -> ray.ObjectRef[int]:
        return call(self.handle, ExperienceService.advance, policy, version)

    def pause(self, policy: str) -> ray.ObjectRef[None]:
        return call(self.handle, ExperienceService.pause, policy)

    def restart(self, policy: str, version: int, final_version: int | None) -> ray.ObjectRef[int]:
        return call(self.handle, ExperienceService.restart, policy, version, final_version)

    def finish(self, policy: str) -> ray.ObjectRef[None]:
        return call(self.handle, ExperienceService.finish, policy)

    def reopen(self, policy: str) -> ray.ObjectRef[None]:
        return call(self.handle, ExperienceService.reopen, policy)

    def stats(
        self, wait_for: tuple[str, int] | None = None, timeout: float = 0.0, *, whole_version: bool = False
    ) -> ray.ObjectRef[dict[str, PolicyStats]]:
        return call(self.handle, ExperienceService.stats, wait_for, timeout, whole_version=whole_version)

    def snapshot(self) -> ray.ObjectRef[BufferSnapshot]:
        return call(self.handle, ExperienceService.snapshot)
