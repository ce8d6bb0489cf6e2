"""What the driver's components share: the job's options (`DriverOptions`), its state, one policy's
run state (`PolicyRun`), and `JobControl` (the stop event, the first fatal error, event reporting,
the clock).

The driver (coordinator/driver.py) composes one component per responsibility, each built from
explicit inputs and holding no reference back to the driver:

    PolicyTrainer     per policy: wait for a step of samples, train, sync weights (training.py)
    Checkpointer      checkpoints, exports and checkpoint requests (checkpoints/checkpointer.py)
    FleetSupervisor   health, drain, elasticity and routes, every poll (fleet_supervisor.py)
    ProducerEventSink what the episode producer reports back (producer_events.py)
    MetricsLog        where each step's record goes: memory, files, sinks (metrics/log.py)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from polyrl_operator.api.progress import EvalProgress
from polyrl_runtime.actors import Actor
from polyrl_runtime.coordinator.failures import JobFailedError, fail_on_error
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.metrics.records import RewardWindow, StepRecord
from polyrl_runtime.coordinator.metrics.startup import StartupPhases
from polyrl_runtime.coordinator.slots import Slot
from polyrl_runtime.experience.buffer import PolicyStats
from polyrl_runtime.trainers.client import TrainerRankClient
from polyrl_runtime.weights.endpoints import PolicyWeightSync

State = Literal["starting", "running", "checkpointing", "done", "failed"]
TrainerState = Literal["training", "restarting", "frozen", "done"]


@dataclass
class DriverOptions:
    out_dir: Path
    checkpoint_root: Path | str  # a local directory or an object-store URI (coordinator/checkpoints/store.py)
    resume: bool = True
    max_consecutive_failures: int = 64
    max_in_flight_per_worker: int = 512
    groups_per_call: int = 4  # episode groups a worker gets per Ray call (a call costs ~1 ms of CPU)
    poll_s: float = 0.5
    same_host: bool = True
    # How long a policy may sit with no credit and no experience anywhere before the job fails.
    stall_timeout_s: float = 30.0
    unused_episodes: int = 2000  # episodes in a row without a turn of a policy before the job fails
    place_by_resource: bool = True  # False: ignore polyrl/<policy>/<role> resources (tests on a plain Ray)
    cpu_sets: dict[str, frozenset[int]] = field(default_factory=dict)  # role -> CPUs (local mode's --cpus)
    # Every actor on one host (`polyrl run`): a CPU policy's trainer and first engine share a process
    # where they can (coordinator/fleet.py `colocated_policies`).
    colocate: bool = False
    on_record: Callable[[StepRecord], None] | None = None
    # Where the per-step metrics series goes (metrics/files.py); None: <checkpoint_root>/metrics.
    metrics_dir: Path | str | None = None
    # Polled every poll_s: the id of a checkpoint request (the pod's checkpoint-request annotation).
    checkpoint_requests: Callable[[], str | None] | None = None
    on_event: Callable[[str, dict[str, Any]], None] | None = None
    attempt: int | None = None  # the pod's POLYRL_ATTEMPT, reported in /progress (None: polyrl run)
    # The start-up phases' durations (metrics/startup.py): the caller may have timed some before the driver's.
    startup: StartupPhases = field(default_factory=StartupPhases)


@dataclass
class PolicyRun:
    """What the driver tracks of one policy: its trainer ranks, weight sync, step and statistics."""

    name: str
    ranks: list[TrainerRankClient]
    sync: PolicyWeightSync | None = None
    step: int = 0
    samples_per_episode: int | None = None
    window: RewardWindow = field(default_factory=lambda: RewardWindow(64))
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    stats: PolicyStats | None = None
    staleness: tuple[float, int] = (0.0, 0)
    # The largest version skew to each other policy among the episodes of its last step.
    version_skew: dict[str, int] = field(default_factory=dict)
    last_reward: float | None = None
    last_ckpt_step: int | None = None
    last_eval: EvalProgress | None = None  # the latest evaluation pass (coordinator/evaluation.py)
    rating: float | None = None  # a league policy's newest rated version's (coordinator/league.py)
    # Versions published beyond the steps taken: a trainer restarted from a checkpoint at step c
    # publishes past every version its engines served (coordinator/policy_restart.py), so a
    # version names one set of weights for the whole run.
    version_offset: int = 0
    trainer_state: TrainerState = "training"
    # `trainer: null` in the spec: frozen from the start (served by its engines, never trained),
    # where a trainer out of restarts is frozen at the step it reached
    served_only: bool = False
    restarts: int = 0  # restarts of this policy's trainer alone, in this coordinator's run

    @property
    def version(self) -> int:
        """The weight version of the policy's latest step (what its engines serve)."""
        return self.step + self.version_offset

    @property
    def training(self) -> bool:
        return self.trainer_state in ("training", "restarting")

    def checkpoint_state(self) -> dict[str, Any]:
        """This policy's entry of a checkpoint's `state.json` (`restored` reads it back)."""
        state: dict[str, Any] = {
            "step": self.step,
            "version": self.version,
            "samples_per_episode": self.samples_per_episode,
            "rewards": self.window.state(),
        }
        if self.last_eval is not None:  # /progress and the RLJob status show it until the next pass
            state["evaluation"] = self.last_eval.to_wire()
        return state

    def restored(self, state: dict[str, Any]) -> None:
        """Take back what `checkpoint_state` saved, but the step and the version: the trainer's load
        sets the step, the driver the version before its first publish (`_resume_versions`)."""
        self.samples_per_episode = state.get("samples_per_episode")
        self.window.restore(state.get("rewards", {}))
        ev = state.get("evaluation")
        self.last_eval = EvalProgress.model_validate(ev) if ev is not None else None


def version_offset(state: dict[str, Any]) -> int:
    """How far a checkpointed policy's version is ahead of its step (`PolicyRun.version_offset`)."""
    return int(state.get("version", state.get("step", 0))) - int(state.get("step", 0))


class JobControl:
    """The stop event, the job's first fatal error, event reporting and the job's clock.

    Every component that can end the job or report an event gets this one object; the first
    failure wins, later ones only stop the job again."""

    def __init__(
        self, on_event: Callable[[str, dict[str, Any]], None] | None, startup: StartupPhases | None = None
    ) -> None:
        self.stop = asyncio.Event()
        self.fatal: JobFailedError | None = None
        self._on_event = on_event
        self.started = time.monotonic()
        self.elapsed_before = 0.0  # the wall time of the attempts before a resume
        self.startup = startup if startup is not None else StartupPhases()

    def fail(self, message: str, *, retryable: bool = True) -> None:
        if self.fatal is None:
            self.fatal = JobFailedError(message, retryable=retryable)
        self.stop.set()

    def emit(self, kind: str, **data: Any) -> None:
        if self._on_event is not None:
            self._on_event(kind, data)

    @contextmanager
    def phase(self, name: str, doing: str) -> Iterator[None]:
        """Time one start-up phase (`StartupPhases`), first reporting what it does (event `startup`)."""
        self.emit("startup", phase=name, doing=doing)
        with self.startup.timed(name):
            yield

    def guarded(self, work: Any, what: str) -> asyncio.Task[None]:
        """A task whose unexpected exception fails the job (retryably), naming it."""
        return fail_on_error(asyncio.create_task(work), what, self.fail)

    def report_lost(self, fleet: Fleet, slots: Sequence[Slot[Actor]]) -> None:
        """Report each engine or workflow worker once, when the fleet first marks it dead (whoever
        saw it die: the weight sync, a workflow worker, the producer or the supervision poll)."""
        for slot in slots:
            if slot.name in fleet.engines.get(slot.policy, {}):
                self.emit("engine_lost", engine=slot.name, policy=slot.policy)
            else:
                self.emit("worker_lost", worker=slot.name)

    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started
