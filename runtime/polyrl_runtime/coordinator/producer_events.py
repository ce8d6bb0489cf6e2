"""What the episode producer reports back (`ProducerEvents`): finished episodes into each policy's
reward window and its league, failures, events and lost workers to the job."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from polyrl_runtime.actors import Actor
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.job_state import JobControl, PolicyRun
from polyrl_runtime.coordinator.league import Leagues
from polyrl_runtime.coordinator.slots import Slot
from polyrl_runtime.workflows.opponents import OpponentRecord


class ProducerEventSink:
    """The episode producer's reports: rewards into each policy's window, the rest to the job."""

    def __init__(
        self, runs: dict[str, PolicyRun], total: int, control: JobControl, fleet: Fleet, leagues: Leagues
    ) -> None:
        self.runs, self.total, self.control, self.fleet, self.leagues = runs, total, control, fleet, leagues

    def still_training(self, policy: str) -> bool:
        run = self.runs[policy]
        return run.step < self.total and run.training

    def episode(
        self, policy: str, reward: float, success: float | None, samples: int, skew: Mapping[str, int]
    ) -> None:
        run = self.runs[policy]
        run.window.add(reward, success, skew)
        run.samples_per_episode = samples

    def opponents(
        self, asked: frozenset[str], played: Mapping[str, OpponentRecord], versions: Mapping[str, int]
    ) -> None:
        self.leagues.episode(asked, played, versions)

    def fail(self, message: str, retryable: bool) -> None:
        self.control.fail(message, retryable=retryable)

    def emit(self, kind: str, **data: Any) -> None:
        self.control.emit(kind, **data)

    def lost(self, slots: Sequence[Slot[Actor]]) -> None:
        self.control.report_lost(self.fleet, slots)
