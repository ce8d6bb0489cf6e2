"""Which roles hold a device pool's devices: its rollout engines, or one policy's trainer at a time.

A pool that hosts trainer ranks and rollout engines alternates them (`PoolScheduler`):

    generation  every engine on the pool awake, every trainer on it offloaded to host memory;
    turn(P)     the engines sleep (level 1: KV cache freed, weights to host memory), P's trainer is
                restored and trains; P's own engines wake (`Turn.wake_own_engines`) and receive the
                new version while P's trainer still holds it; P's trainer is offloaded again.
                The next waiting turn follows at once (the engines still asleep); when none waits,
                every engine wakes and generation resumes.

In sync mode this is "generate for the pool's policies, train each, update weights": a sync step
starts only once its version's episodes are all in, so the pool's policies ask for their turns
together. In async mode a policy asks when it has a step's samples, which its staleness budget
bounds; the engines generate between turns.

**No policy starves.** Turns are granted first come, first served (an `asyncio.Lock` wakes its
waiters in order) and a policy asks for one turn per step, so while two policies of a pool both
have a step's samples waiting, neither trains twice before the other trains once: over any stretch
in which both always have work, their step counts differ by at most one.

Checkpoints and exports need the trainer's tensors: they take a turn without training
(`resident(P)`). A weight update to engines on this pool from a trainer elsewhere (a dedicated
trainer) waits until no turn holds the pool (`delivery(P)`), and a turn waits for the updates under
way: an engine asleep refuses updates.

A pool with no trainer on it needs no scheduling (its engines never sleep), and roles on dedicated
pods are never scheduled: `DevicePools` answers for them with contexts that do nothing.

**Only GPU pools take turns.** A pool without GPUs is a set of cores its roles share, which the
operating system schedules: its memory is the host's, where offloading would copy a trainer's state
into the same memory, an idle engine holds no core, and exclusive turns would leave cores idle that
another policy's trainer could use. (Measured with `benchmarks/sharing.py`'s tiny policies on two
cores: switching memory cost about 20 ms a turn, a fifth of a step, and turns without it left four
pooled policies 4% slower than dedicated roles.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from polyrl_operator.api.spec import RLJobSpec

log = structlog.get_logger(__name__)


class PoolSwitchError(RuntimeError):
    """A role on a pool could not sleep, wake, offload or restore (a restore or wake out of device
    memory among them); the message names the pool, the policy and the role's own error."""


class PooledEngine(Protocol):
    """What the scheduler calls on a rollout engine (`EngineClient`, or an engine in-process)."""

    def sleep(self, level: int = 1) -> Awaitable[object]: ...

    def wake_up(self) -> Awaitable[object]: ...


class PooledRank(Protocol):
    """What the scheduler calls on a trainer rank (`TrainerRankClient`, or a rank in-process)."""

    def offload(self) -> Awaitable[object]: ...

    def restore(self) -> Awaitable[object]: ...


@dataclass(frozen=True)
class PoolRoles:
    """The policies whose trainer and whose rollout a pool hosts (in the spec's policy order)."""

    pool: str
    trainers: tuple[str, ...]
    rollouts: tuple[str, ...]

    @property
    def scheduled(self) -> bool:
        """Whether it hosts a trainer, the one role whose memory a turn moves; `device_pools`
        schedules such a pool when it has GPUs (a CPU pool's roles share its cores)."""
        return bool(self.trainers)


def pool_roles(spec: RLJobSpec) -> list[PoolRoles]:
    """Every pool of the spec with the roles placed on it."""
    return [
        PoolRoles(
            q.name,
            tuple(p.name for p in spec.policies if p.trainer_pool == q.name),
            tuple(p.name for p in spec.policies if p.rollout.pool == q.name),
        )
        for q in spec.pools or ()
    ]


@dataclass
class PoolUsage:
    """What a pool's devices did: the figures `/progress`, the status and metrics.jsonl report.

    `switches` counts changes of holder (engines to a trainer, one trainer to another, a trainer
    back to the engines); `switch_s` is the time spent sleeping, waking, offloading and restoring;
    `trainer_s[P]` the time P's trainer was resident; `busy_s` the time a turn held the pool (exact,
    added as each turn ends) plus the time the engines had episodes to generate outside turns
    (sampled by `PoolScheduler.watch`)."""

    started: float
    switches: int = 0
    switch_s: float = 0.0
    turns: dict[str, int] = field(default_factory=dict)
    trainer_s: dict[str, float] = field(default_factory=dict)
    busy_s: float = 0.0

    def busy_fraction(self, now: float) -> float:
        wall = now - self.started
        return min(1.0, self.busy_s / wall) if wall > 0 else 0.0


@dataclass(frozen=True)
class TurnMetrics:
    pool: str
    pool_resident_s: float
    pool_switch_s: float
    pool_switches_total: int
    pool_busy_fraction: float


class Turn:
    """The pool held by one policy's trainer (`PoolScheduler.turn`); once it has ended, what it cost:
    the seconds the trainer held the pool and, of those, the seconds spent switching."""

    def __init__(self, scheduler: PoolScheduler, policy: str) -> None:
        self._scheduler, self.policy = scheduler, policy
        self.pool = scheduler.roles.pool
        self.resident_s = 0.0
        self.switch_s = 0.0

    async def wake_own_engines(self) -> None:
        """Wake this policy's engines on the pool (if asleep) so that they can take its new
        version while the trainer still holds it; the others sleep on."""
        await self._scheduler._wake(self.policy)


class PoolScheduler:
    """Turns on one pool (see the module docstring). `engines(P)` and `ranks(P)` give policy P's
    engines on the pool and trainer ranks at the moment of asking (engines come and go)."""

    def __init__(
        self,
        roles: PoolRoles,
        engines: Callable[[str], Sequence[PooledEngine]],
        ranks: Callable[[str], Sequence[PooledRank]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.roles, self._engines, self._ranks, self._clock = roles, engines, ranks, clock
        self.usage = PoolUsage(started=clock())
        self._turns = asyncio.Lock()  # FIFO: the starvation bound rests on it
        self._queued = 0  # turns asked for and not yet granted
        self._state = asyncio.Condition()
        self._in_turn: str | None = None
        self._turns_begun = 0  # a sampling interval that saw a turn begin is not generation time
        self._deliveries = 0
        # The engines this pool put to sleep. One engine may serve several policies (a shared base's
        # adapters), so it is one entry here, whichever policies it serves.
        self._asleep: list[PooledEngine] = []
        self._offloaded: set[str] = set()
        self._holder = "engines"
        # The engines serve (not asleep, nor sleeping in a turn): what a delivery waits for. False
        # from a turn's first sleep until the last queued turn has woken them.
        self._awake = True
        self._current = Turn(self, "")  # the turn switches are counted to (none yet)

    # -- what the coordinator calls ------------------------------------------------------------

    def now(self) -> float:
        """The scheduler's clock, which its usage figures are measured on."""
        return self._clock()

    async def park_trainers(self) -> None:
        """Offload every trainer on the pool: the state between turns (after start-up)."""
        async with self._turns:
            for p in self.roles.trainers:
                await self._offload(p)

    @asynccontextmanager
    async def turn(self, policy: str, *, training: bool = True) -> AsyncIterator[Turn]:
        """Hold the pool for `policy`'s trainer: engines asleep, its ranks restored (and offloaded
        again on the way out). `training` False: a checkpoint or an export, counted apart."""
        self._queued += 1
        try:
            await self._turns.acquire()
        finally:
            self._queued -= 1
        try:
            async with self._state:
                await self._state.wait_for(lambda: self._deliveries == 0)
                self._in_turn = policy
                self._turns_begun += 1
            started = self._clock()
            self._current = Turn(self, policy)
            failed = True
            try:
                await self._sleep_all()
                await self._restore(policy)
                self._switch_to(f"trainer {policy}")
                if training:
                    self.usage.turns[policy] = self.usage.turns.get(policy, 0) + 1
                yield self._current
                failed = False
            finally:
                await self._leave_turn(policy, started, failed)
        finally:
            self._turns.release()

    @asynccontextmanager
    async def delivery(self, policy: str) -> AsyncIterator[None]:
        """A weight update from `policy`'s trainer, elsewhere, to its engines here: waits until no
        turn holds the pool (engines awake) and keeps turns out until it is done."""
        async with self._state:
            if self._in_turn is not None or not self._awake:
                log.info("pool.update_waits", pool=self.roles.pool, policy=policy, turn=self._in_turn)
            await self._state.wait_for(lambda: self._in_turn is None and self._awake)
            self._deliveries += 1
        try:
            yield
        finally:
            async with self._state:
                self._deliveries -= 1
                self._state.notify_all()

    async def watch(self, generating: Callable[[], bool], stop: asyncio.Event, every_s: float = 0.25) -> None:
        """Sample the busy time until `stop`: a turn holds the pool, or the engines are awake and
        `generating()` (episodes of the pool's policies in flight). Turns count themselves, exactly
        (`_leave_turn`); an interval a turn overlapped adds nothing here, so no time counts twice."""
        last, begun = self._clock(), self._turns_begun
        while not stop.is_set():
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
            now = self._clock()
            if self._in_turn is None and self._turns_begun == begun and generating():
                self.usage.busy_s += now - last
            last, begun = now, self._turns_begun

    # -- the switches ----------------------------------------------------------------------------

    async def _leave_turn(self, policy: str, started: float, failed: bool) -> None:
        try:
            await self._offload(policy)
            if self._queued == 0:  # no turn waits: back to generation
                await self._wake_all()
                self._switch_to("engines")
        except Exception as e:
            if not failed:
                raise
            # The turn failed already (the job fails with that error): this one is only logged.
            log.warning("pool.switch_after_failure", pool=self.roles.pool, policy=policy, error=str(e))
        finally:
            held = self._current.resident_s = self._clock() - started
            self.usage.trainer_s[policy] = self.usage.trainer_s.get(policy, 0.0) + held
            self.usage.busy_s += held
            async with self._state:
                self._in_turn = None
                # After a failed wake too: an update then meets the engine's own refusal (reported as
                # that engine's failure) rather than waiting for a wake that will not come.
                self._awake = self._awake or self._queued == 0
                self._state.notify_all()

    def _switch_to(self, holder: str) -> None:
        if holder != self._holder:
            self.usage.switches += 1
            self._holder = holder

    async def _timed(self, policy: str, role: str, what: str, calls: Iterable[Awaitable[object]]) -> None:
        start = self._clock()
        try:
            await asyncio.gather(*calls)
        except Exception as e:
            raise PoolSwitchError(
                f"pool {self.roles.pool}: policy {policy}: {role} could not {what}: {e}"
            ) from e
        finally:
            took = self._clock() - start
            self.usage.switch_s += took
            self._current.switch_s += took

    async def _sleep_all(self) -> None:
        self._awake = False
        for p in self.roles.rollouts:
            awake = [e for e in self._engines(p) if not any(e is a for a in self._asleep)]
            if awake:
                await self._timed(p, "its rollout engines", "sleep", (e.sleep(1) for e in awake))
                self._asleep.extend(awake)

    async def _wake(self, policy: str) -> None:
        """Wake the engines asleep that serve `policy` (an engine replaced meanwhile is gone)."""
        live = self._engines(policy)
        wake = [e for e in self._asleep if any(e is x for x in live)]
        self._asleep = [e for e in self._asleep if not any(e is x for x in live)]
        if wake:
            await self._timed(policy, "its rollout engines", "wake up", (e.wake_up() for e in wake))

    async def _wake_all(self) -> None:
        for p in self.roles.rollouts:
            await self._wake(p)
        self._asleep.clear()  # engines that left the pool while asleep

    async def _restore(self, policy: str) -> None:
        if policy in self._offloaded:
            await self._timed(
                policy, "its trainer", "be restored", (r.restore() for r in self._ranks(policy))
            )
            self._offloaded.discard(policy)

    async def _offload(self, policy: str) -> None:
        if policy in self.roles.trainers and policy not in self._offloaded:
            await self._timed(
                policy, "its trainer", "be offloaded", (r.offload() for r in self._ranks(policy))
            )
            self._offloaded.add(policy)


class DevicePools:
    """The job's pool schedulers, by the policy whose trainer or rollout they host."""

    def __init__(self, schedulers: Mapping[str, PoolScheduler], spec: RLJobSpec) -> None:
        self.schedulers = dict(schedulers)
        self._trainer = {p.name: self.schedulers.get(p.trainer_pool or "") for p in spec.policies}
        self._rollout = {p.name: self.schedulers.get(p.rollout.pool or "") for p in spec.policies}

    @asynccontextmanager
    async def training(self, policy: str) -> AsyncIterator[Turn | None]:
        """A training step of `policy`: a turn on its trainer's pool, or nothing to wait for."""
        s = self._trainer[policy]
        if s is None:
            yield None
            return
        async with s.turn(policy) as t:
            yield t

    @asynccontextmanager
    async def resident(self, policy: str) -> AsyncIterator[None]:
        """`policy`'s trainer on its devices, for a checkpoint, an export or a load."""
        s = self._trainer[policy]
        if s is None:
            yield
            return
        async with s.turn(policy, training=False):
            yield

    @asynccontextmanager
    async def delivery(self, policy: str, turn: Turn | None) -> AsyncIterator[None]:
        """A weight update of `policy` to its engines: inside its own turn, its engines wake; on a
        pool its trainer does not hold, the update waits for that pool's turns."""
        s = self._rollout[policy]
        if s is None:
            yield
        elif turn is not None and s is self._trainer[policy]:
            await turn.wake_own_engines()
            yield
        else:
            async with s.delivery(policy):
                yield

    async def park_trainers(self) -> None:
        await asyncio.gather(*(s.park_trainers() for s in self.schedulers.values()))

    def turn_metrics(self, turn: Turn) -> TurnMetrics:
        """What a step that ran in `turn` reports of its pool (`StepRecord`'s pool fields)."""
        scheduler = self.schedulers[turn.pool]
        usage = scheduler.usage
        return TurnMetrics(
            pool=turn.pool,
            pool_resident_s=turn.resident_s,
            pool_switch_s=turn.switch_s,
            pool_switches_total=usage.switches,
            pool_busy_fraction=usage.busy_fraction(scheduler.now()),
        )

    def usage(self) -> dict[str, PoolUsage]:
        return {n: s.usage for n, s in self.schedulers.items()}


def device_pools(
    spec: RLJobSpec,
    engines: Callable[[str], Sequence[PooledEngine]],
    ranks: Callable[[str], Sequence[PooledRank]],
) -> DevicePools:
    """A scheduler for each GPU pool that hosts a trainer (`PoolRoles.scheduled`)."""
    schedulers = {
        r.pool: PoolScheduler(r, engines, ranks)
        for r in pool_roles(spec)
        if r.scheduled and spec.pool(r.pool).gpus > 0
    }
    return DevicePools(schedulers, spec)
