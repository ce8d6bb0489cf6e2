"""The pool scheduler (coordinator/pool_scheduler.py) over in-process roles that check, at every
call, what the pool's devices hold: never two trainers resident at once, never an engine awake
beside a trainer other than its own policy's, every update to an awake engine, and the starvation
bound (two policies that always have work train within one step of each other)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from driver_harness import BASE, policy

from polyrl_operator.api import RLJob
from polyrl_runtime.coordinator.pool_scheduler import (
    DevicePools,
    PoolRoles,
    PoolScheduler,
    PoolSwitchError,
    device_pools,
    pool_roles,
)


@dataclass
class Devices:
    """What one pool's devices hold; each role checks the invariants as it switches."""

    resident: set[str] = field(default_factory=set)  # policies whose trainer is on the devices
    # engines awake, by name "<policy>-<i>" ("<policy>+<policy>-<i>": one serving both policies)
    awake: set[str] = field(default_factory=set)
    log: list[str] = field(default_factory=list)

    def check(self) -> None:
        assert len(self.resident) <= 1, f"two trainers resident: {self.resident}"
        for trainer in self.resident:
            others = {e for e in self.awake if trainer not in e.rsplit("-", 1)[0].split("+")}
            assert not others, f"engines {others} awake beside trainer {trainer}"


async def _done(value: object = None) -> object:
    await asyncio.sleep(0)
    return value


class FakeEngine:
    def __init__(self, devices: Devices, name: str) -> None:
        self.devices, self.name = devices, name
        devices.awake.add(name)

    def sleep(self, level: int = 1) -> Awaitable[object]:
        assert self.name in self.devices.awake, f"{self.name} put to sleep twice"
        self.devices.awake.discard(self.name)
        self.devices.log.append(f"sleep {self.name}")
        return _done()

    def wake_up(self) -> Awaitable[object]:
        assert self.name not in self.devices.awake, f"{self.name} woken while awake"
        self.devices.awake.add(self.name)
        self.devices.log.append(f"wake {self.name}")
        self.devices.check()
        return _done()

    def receive(self, version: int) -> None:
        assert self.name in self.devices.awake, f"update {version} to {self.name} while it sleeps"
        self.devices.log.append(f"update {self.name} v{version}")


class FakeRank:
    def __init__(self, devices: Devices, policy: str, fail_restore: str | None = None) -> None:
        self.devices, self.policy, self.fail_restore = devices, policy, fail_restore

    def offload(self) -> Awaitable[object]:
        self.devices.resident.discard(self.policy)
        self.devices.log.append(f"offload {self.policy}")
        return _done()

    def restore(self) -> Awaitable[object]:
        if self.fail_restore is not None:
            raise RuntimeError(self.fail_restore)
        self.devices.resident.add(self.policy)
        self.devices.log.append(f"restore {self.policy}")
        self.devices.check()
        return _done()


def _pool(
    trainers: tuple[str, ...], rollouts: tuple[str, ...], engines_per_policy: int = 1, **rank_kw: str
) -> tuple[PoolScheduler, Devices, dict[str, list[FakeEngine]]]:
    devices = Devices()
    engines = {p: [FakeEngine(devices, f"{p}-{i}") for i in range(engines_per_policy)] for p in rollouts}
    ranks = {p: [FakeRank(devices, p, rank_kw.get(p))] for p in trainers}
    devices.resident.update(trainers)  # as after start-up: resident until parked
    return (
        PoolScheduler(PoolRoles("main", trainers, rollouts), engines.__getitem__, ranks.__getitem__),
        devices,
        engines,
    )


async def _step(s: PoolScheduler, engines: dict[str, list[FakeEngine]], p: str, version: int) -> None:
    async with s.turn(p) as turn:
        assert p in s._ranks(p)[0].devices.resident  # type: ignore[attr-defined]
        await turn.wake_own_engines()
        for e in engines.get(p, ()):
            e.receive(version)


async def test_a_colocated_policy_sleeps_its_engines_trains_then_updates_them() -> None:
    s, devices, engines = _pool(("a",), ("a",), engines_per_policy=2)
    await s.park_trainers()
    await _step(s, engines, "a", 1)
    assert devices.log == [
        "offload a",
        "sleep a-0",
        "sleep a-1",
        "restore a",
        "wake a-0",
        "wake a-1",
        "update a-0 v1",
        "update a-1 v1",
        "offload a",
    ]
    assert devices.awake == {"a-0", "a-1"} and not devices.resident
    assert s.usage.turns == {"a": 1} and s.usage.switches == 2  # to the trainer and back


async def test_two_policies_generate_then_train_each_then_update() -> None:
    s, devices, engines = _pool(("a", "b"), ("a", "b"))
    await s.park_trainers()
    devices.log.clear()
    await asyncio.gather(_step(s, engines, "a", 1), _step(s, engines, "b", 1))
    assert devices.log == [
        "sleep a-0",
        "sleep b-0",
        "restore a",
        "wake a-0",
        "update a-0 v1",
        "offload a",
        "sleep a-0",  # b's turn follows at once: a's engine sleeps again, b's is still asleep
        "restore b",
        "wake b-0",
        "update b-0 v1",
        "offload b",
        "wake a-0",  # no turn waits: generation again
    ]
    assert s.usage.turns == {"a": 1, "b": 1}
    assert s.usage.switches == 3  # engines -> trainer a -> trainer b -> engines


async def test_an_engine_serving_two_policies_sleeps_once_and_wakes_for_either() -> None:
    """One engine holds a shared base and both policies' adapters (`engines(a)` and `engines(b)` both
    give it): a turn puts it to sleep once, and either policy's turn wakes it for its update."""
    devices = Devices()
    shared = FakeEngine(devices, "a+b-0")
    ranks = {p: [FakeRank(devices, p)] for p in ("a", "b")}
    devices.resident.update(ranks)
    s = PoolScheduler(PoolRoles("main", ("a", "b"), ("a", "b")), lambda p: [shared], ranks.__getitem__)
    await s.park_trainers()
    devices.log.clear()
    for p in ("a", "b"):
        async with s.turn(p) as turn:
            await turn.wake_own_engines()
            shared.receive(1)
    assert devices.log == [
        "sleep a+b-0",
        "restore a",
        "wake a+b-0",
        "update a+b-0 v1",
        "offload a",
        "sleep a+b-0",
        "restore b",
        "wake a+b-0",
        "update a+b-0 v1",
        "offload b",
    ]


async def test_no_policy_starves_while_both_have_work() -> None:
    """The bound in the module docstring: a trainer 5x faster than the other gets no more turns."""
    s, _devices, _engines = _pool(("fast", "slow"), ("fast", "slow"))
    await s.park_trainers()
    stop = asyncio.Event()
    steps = {"fast": 0, "slow": 0}
    gaps: list[int] = []

    async def train(p: str, seconds: float) -> None:
        while not stop.is_set():
            async with s.turn(p) as turn:
                await asyncio.sleep(seconds)
                await turn.wake_own_engines()
            steps[p] += 1
            gaps.append(abs(steps["fast"] - steps["slow"]))

    async def stop_later() -> None:
        await asyncio.sleep(0.3)
        stop.set()

    await asyncio.gather(train("fast", 0.002), train("slow", 0.01), stop_later())
    assert steps["slow"] >= 10
    assert max(gaps) <= 1, steps


async def test_an_update_from_a_dedicated_trainer_waits_for_the_turn_and_holds_off_the_next() -> None:
    s, _devices, engines = _pool(("a",), ("a", "d"))
    await s.park_trainers()
    order: list[str] = []
    in_turn = asyncio.Event()
    release = asyncio.Event()

    async def turn_a() -> None:
        async with s.turn("a"):
            in_turn.set()
            await release.wait()
            order.append("a trained")

    async def update_d() -> None:
        await in_turn.wait()
        async with s.delivery("d"):
            engines["d"][0].receive(1)  # awake: the turn has ended
            order.append("d updated")
            await asyncio.sleep(0.01)
        order.append("d done")

    async def next_turn() -> None:
        await asyncio.sleep(0.005)
        release.set()
        await asyncio.sleep(0.005)  # d's update has begun
        async with s.turn("a"):
            order.append("a again")

    await asyncio.gather(turn_a(), update_d(), next_turn())
    assert order == ["a trained", "d updated", "d done", "a again"]


async def test_a_role_that_cannot_restore_fails_naming_pool_policy_and_bytes() -> None:
    msg = "trainer rank a-0: 2147483648 bytes do not fit on cuda:0 (1073741824 free)"
    s, devices, _engines = _pool(("a",), ("a",), a=msg)
    await s.park_trainers()
    with pytest.raises(PoolSwitchError) as e:
        async with s.turn("a"):
            pytest.fail("the turn must not start")
    assert str(e.value).startswith("pool main: policy a: its trainer could not be restored: ")
    assert "2147483648 bytes" in str(e.value)
    assert devices.awake == {"a-0"}  # the turn failed: generation goes on, the job fails on the error
    async with s.delivery("a"):  # the pool is free again
        pass


async def test_a_checkpoint_turn_restores_without_counting_a_step() -> None:
    s, devices, _engines = _pool(("a",), ("a",))
    await s.park_trainers()
    async with s.turn("a", training=False):
        assert devices.resident == {"a"} and not devices.awake
    assert s.usage.turns == {} and devices.awake == {"a-0"} and not devices.resident


def _job(*pooled: tuple[str, str, str], gpus: int = 0) -> RLJob:
    """BASE with policies a, b, c; `pooled` places (policy, role, pool) on pools of `gpus` GPUs."""
    pols = [policy(n) for n in "abc"]
    pools: dict[str, dict[str, object]] = {}
    for name, role, pool in pooled:
        p = next(p for p in pols if p["name"] == name)
        p[role] = {k: v for k, v in p[role].items() if k not in ("replicas", "gpus", "gpuType")} | {
            "pool": pool
        }
        pools[pool] = {"name": pool, "gpus": gpus}
    spec = {**BASE["spec"], "policies": pols, "pools": list(pools.values()) or None}
    return RLJob.model_validate({**BASE, "spec": {k: v for k, v in spec.items() if v is not None}})


@pytest.mark.parametrize(
    ("pooled", "expected"),
    [
        ((), []),
        ((("a", "rollout", "x"), ("b", "rollout", "x")), [PoolRoles("x", (), ("a", "b"))]),
        (
            (("a", "rollout", "x"), ("a", "trainer", "x"), ("b", "trainer", "x")),
            [PoolRoles("x", ("a", "b"), ("a",))],
        ),
        (
            (("a", "trainer", "t"), ("b", "trainer", "t"), ("a", "rollout", "g"), ("b", "rollout", "g")),
            [PoolRoles("t", ("a", "b"), ()), PoolRoles("g", (), ("a", "b"))],
        ),
    ],
    ids=["no-pools", "engines-only", "colocated-and-a-trainer", "a-trainer-pool-and-an-engine-pool"],
)
def test_pool_roles(pooled: tuple[tuple[str, str, str], ...], expected: list[PoolRoles]) -> None:
    spec = _job(*pooled, gpus=1).spec
    assert pool_roles(spec) == expected
    pools = device_pools(spec, lambda p: [], lambda p: [])
    assert sorted(pools.schedulers) == sorted(r.pool for r in expected if r.trainers)
    # The same layout on CPU pools: sets of cores the OS schedules, never turns.
    assert pool_roles(_job(*pooled).spec) == expected
    assert device_pools(_job(*pooled).spec, lambda p: [], lambda p: []).schedulers == {}


async def test_roles_on_dedicated_pods_and_engine_only_pools_are_never_scheduled() -> None:
    spec = _job(("a", "rollout", "x"), ("b", "rollout", "x")).spec
    called: list[str] = []

    def nothing(p: str) -> list[FakeEngine]:
        called.append(p)
        return []

    pools: DevicePools = device_pools(spec, nothing, nothing)  # type: ignore[arg-type]
    async with pools.training("a") as turn:
        assert turn is None
        async with pools.delivery("a", turn), pools.resident("a"):
            pass
    await pools.park_trainers()
    assert called == [] and pools.usage() == {}


async def test_busy_time_counts_turns_and_generation() -> None:
    now = [0.0]
    clock: Callable[[], float] = lambda: now[0]  # noqa: E731
    devices = Devices()
    s = PoolScheduler(PoolRoles("main", ("a",), ()), lambda p: [], lambda p: [FakeRank(devices, p)], clock)
    stop = asyncio.Event()
    generating = [True]

    async def ticks() -> None:
        for generating[0] in (True, True, False, False):
            await asyncio.sleep(0.02)
            now[0] += 1.0
        stop.set()

    await asyncio.gather(s.watch(lambda: generating[0], stop, every_s=0.005), ticks())
    assert 1.0 <= s.usage.busy_s <= 3.0
    assert 0.25 <= s.usage.busy_fraction(now[0]) <= 0.75


async def test_a_turn_counts_its_held_time_exactly_and_no_interval_counts_twice() -> None:
    """A step's busy fraction is read right after its turn: the turn's time is in it however short
    the turn was against the sampling period, and generation that overlapped the turn adds nothing."""
    now = [0.0]
    clock: Callable[[], float] = lambda: now[0]  # noqa: E731
    devices = Devices()
    s = PoolScheduler(PoolRoles("main", ("a",), ()), lambda p: [], lambda p: [FakeRank(devices, p)], clock)
    stop = asyncio.Event()
    watcher = asyncio.create_task(s.watch(lambda: True, stop, every_s=3600.0))  # never samples in time
    await asyncio.sleep(0)
    async with s.turn("a"):
        now[0] += 2.0
    assert s.usage.busy_s == 2.0 and s.usage.busy_fraction(now[0]) == 1.0
    now[0] += 2.0
    stop.set()
    await watcher  # its one interval [0, 4] saw the turn begin: the turn's 2 s only
    assert s.usage.busy_s == 2.0 and s.usage.busy_fraction(now[0]) == 0.5


async def test_an_update_waits_through_queued_turns_until_the_engines_wake() -> None:
    s, devices, engines = _pool(("a", "b"), ("a", "b", "d"))
    await s.park_trainers()
    order: list[str] = []
    started = asyncio.Event()

    async def train(p: str) -> None:
        async with s.turn(p):
            started.set()
            await asyncio.sleep(0.01)
            order.append(f"{p} trained")

    async def update_d() -> None:
        await started.wait()
        async with s.delivery("d"):
            engines["d"][0].receive(1)  # asserts the engine is awake
            order.append("d updated")

    await asyncio.gather(train("a"), train("b"), update_d())
    assert order == ["a trained", "b trained", "d updated"]
    assert devices.awake == {"a-0", "b-0", "d-0"}
