"""The fleet. Drain bookkeeping, with stand-in actor handles: an engine is reported drained only when
no worker can still send it work and none waits on a request to it, not merely when its own count is 0.
CPU sets per role, with real actors."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import ray
from driver_harness import make_job, policy

from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.placement import colocated_policies, shared_trainers
from polyrl_runtime.coordinator.slots import EngineSlot, Slot
from polyrl_runtime.engines.api import EngineStats
from polyrl_runtime.engines.client import EngineClient
from polyrl_runtime.models import policy_seed
from polyrl_runtime.workflows.client import WorkflowWorkerClient
from polyrl_runtime.workflows.runner import WorkerStats, WorkflowWorker


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            return self.fn(*args)

        return call()


class _Engine:
    def __init__(self, name: str) -> None:
        self.in_flight = 0
        self.stats = _Method(lambda: EngineStats(name, "agent", 1, self.in_flight, 0, 0.0, 0, 0, False))


class _Worker:
    """A workflow worker as the fleet sees it: routes arrive (perhaps late), requests are pending."""

    def __init__(self) -> None:
        self.routes_epoch = 0
        self.pending: dict[str, int] = {}
        self.hold = False  # set_routes "in transit": not applied yet
        self.set_routes = _Method(self._set_routes)
        self.stats = _Method(self._stats)

    def _stats(self) -> WorkerStats:
        return WorkerStats(0, 0.0, "", dict(self.pending), self.routes_epoch)

    def _set_routes(self, routes: Any, epoch: int) -> None:
        if not self.hold:
            self.routes_epoch = max(self.routes_epoch, epoch)


def _fleet() -> tuple[Fleet, _Engine, _Worker]:
    job = make_job(policies=[policy(rollout={"replicas": {"min": 2, "max": 2}})])
    fleet = Fleet(job, "objectstore", place_by_resource=False)
    engine, worker = _Engine("agent-rollout-0"), _Worker()
    # Stand-ins for the actor handles: the clients call `handle.<method>.remote(...)`.
    fleet.engines["agent"]["agent-rollout-0"] = Slot("agent-rollout-0", EngineClient(engine), policy="agent")
    fleet.engines["agent"]["agent-rollout-1"] = Slot(
        "agent-rollout-1",
        EngineClient(_Engine("agent-rollout-1")),
        policy="agent",
    )
    fleet.workers["workflow-0"] = Slot("workflow-0", WorkflowWorkerClient(worker))
    return fleet, engine, worker


def _drained(slot: EngineSlot) -> bool:  # a call, so that the checker does not narrow the property
    return slot.drained


def test_a_draining_engine_is_drained_only_once_every_worker_has_new_routes_and_no_request_to_it() -> None:
    async def scenario() -> None:
        fleet, engine, worker = _fleet()
        slot = fleet.engines["agent"]["agent-rollout-0"]
        worker.pending = {"agent-rollout-0": 1}  # a request sent, not yet seen by the engine
        assert fleet.set_draining("agent-rollout-0", True)
        worker.hold = True
        await fleet.push_routes()  # the new routes have not reached the worker yet
        await fleet.poll()
        assert engine.in_flight == 0 and not _drained(slot)  # the engine's own count says 0: not enough
        worker.hold = False
        await fleet.push_routes()
        await fleet.poll()
        assert not _drained(slot)  # routes are out, but the worker still waits on the engine
        worker.pending = {}
        await fleet.poll()
        assert _drained(slot)
        assert not _drained(fleet.engines["agent"]["agent-rollout-1"])
        assert fleet.set_draining("agent-rollout-0", False) and not _drained(slot)

    asyncio.run(scenario())


def test_a_workflow_worker_ignores_routes_older_than_the_ones_it_holds() -> None:
    worker = WorkflowWorker.__new__(WorkflowWorker)  # only the routing state: no job, no buffer
    worker.routes_epoch = 0
    installed: list[Any] = []
    worker.pool = type("Pool", (), {"set_routes": lambda _self, r: installed.append(r)})()
    worker.set_routes({"agent": {"new": 1}}, 5)
    worker.set_routes({"agent": {"old": 1}}, 4)  # overtaken on its way: must not win
    assert installed == [{"agent": {"new": 1}}] and worker.routes_epoch == 5


def _thread_masks(actor: Any) -> set[frozenset[int]]:
    """The distinct CPU masks of every thread of an actor's process."""

    def masks(_self: Any) -> set[frozenset[int]]:
        return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}

    return set(ray.get(actor.__ray_call__.remote(masks)))


def test_each_role_runs_on_its_cpu_set(ray_local: Any) -> None:
    """`--cpus`: engines, workflow workers and trainers each start pinned (every thread) to their CPUs."""
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    job = make_job()
    sets = {"rollout": frozenset({first}), "workflow": frozenset({last}), "trainer": frozenset({last})}
    fleet = Fleet(job, "objectstore", place_by_resource=False, cpu_sets=sets)
    plain = Fleet(job, "objectstore", place_by_resource=False)
    engine = fleet.new_engine(job.spec.policies[0]).actor.handle
    worker = fleet.new_worker(job.model_dump_json(by_alias=True), None).actor.handle
    (trainer,) = fleet.new_trainers(job.spec.policies[0], None)
    unpinned = plain.new_engine(job.spec.policies[0]).actor.handle
    try:
        assert _thread_masks(engine) == {sets["rollout"]}
        assert _thread_masks(worker) == {sets["workflow"]}
        assert _thread_masks(trainer.handle) == {sets["trainer"]}
        assert _thread_masks(unpinned) == {frozenset(os.sched_getaffinity(0))}
    finally:
        fleet.close()
        plain.close()


def test_without_placement_resources_a_dead_actors_unit_is_free_once() -> None:
    """What Ray's resource accounting gives housekeeping otherwise: one free unit per dead actor of
    the role, however many parts report the death, until a replacement takes it."""
    fleet, _, _ = _fleet()
    assert fleet.free_units("agent", "rollout") == 0 and fleet.free_units(None, "workflow") == 0
    assert [s.name for s in fleet.mark_dead({"agent-rollout-0"})] == ["agent-rollout-0"]
    assert fleet.mark_dead({"agent-rollout-0"}) == []  # reported again (a worker, the sync): no new unit
    assert fleet.free_units("agent", "rollout") == 1 and fleet.free_units(None, "workflow") == 0
    slot = fleet.workers["workflow-0"]
    assert fleet.mark_worker_dead(slot) and not fleet.mark_worker_dead(slot)
    assert fleet.free_units(None, "workflow") == 1
    fleet._refill("agent", "rollout")  # what new_engine does once its actor is started
    assert fleet.free_units("agent", "rollout") == 0


def test_an_actor_marked_dead_while_a_poll_awaits_it_is_reported_once() -> None:
    """The producer (or a sync) may see an actor die while a poll waits on its stats: the poll must
    not report it again (a job's `worker_lost` came twice for one worker)."""

    async def scenario() -> None:
        fleet, engine, worker = _fleet()
        slot, engine_slot = fleet.workers["workflow-0"], fleet.engines["agent"]["agent-rollout-0"]

        def dies_meanwhile() -> Any:
            assert fleet.mark_worker_dead(slot)  # the producer's report, during the poll's await
            raise RuntimeError("actor died")

        def engine_dies_meanwhile() -> Any:
            assert fleet.mark_dead({"agent-rollout-0"})  # a weight sync's report
            raise RuntimeError("actor died")

        worker.stats = _Method(dies_meanwhile)
        engine.stats = _Method(engine_dies_meanwhile)
        assert await fleet.poll() == []
        assert slot.dead and engine_slot.dead
        assert fleet.free_units(None, "workflow") == 1 and fleet.free_units("agent", "rollout") == 1

    asyncio.run(scenario())


POOL = {"name": "shared", "gpus": 0, "replicas": {"min": 1, "max": 1}}
POOLED = {"pool": "shared"}


@pytest.mark.parametrize(
    ("spec", "transport", "cpu_sets", "colocated"),
    [
        ({}, "objectstore", {}, {"agent"}),  # one CPU rank, the torch engine: one process
        ({}, "shm", {}, {"agent"}),
        ({}, "collective", {}, set()),  # a broadcast needs a second process to receive it
        ({"rollout": {"replicas": {"min": 2, "max": 3}}}, "objectstore", {}, {"agent"}),  # the first engine
        ({"trainer": {"replicas": 2}}, "objectstore", {}, set()),  # two ranks
        ({"trainer": {"ranksPerPod": 2}}, "objectstore", {}, set()),
        ({"trainer": {"gpus": 1}}, "objectstore", {}, set()),
        ({"rollout": {"gpus": 1}}, "objectstore", {}, set()),
        ({"rollout": {"engine": "vllm", "gpus": 1}}, "objectstore", {}, set()),
        ({"rollout": {"replicas": None, "gpus": None, **POOLED}}, "objectstore", {}, set()),
        ({}, "objectstore", {"trainer": frozenset({1})}, set()),  # roles pinned to cores of their own
        ({}, "objectstore", {"rollout": frozenset({0})}, set()),
        ({}, "objectstore", {"workflow": frozenset({0})}, {"agent"}),
    ],
)
def test_which_policies_share_a_process_between_trainer_and_engine(
    spec: dict[str, Any], transport: str, cpu_sets: dict[str, frozenset[int]], colocated: set[str]
) -> None:
    pools = {"pools": [POOL]} if "pool" in spec.get("rollout", {}) else {}
    job = make_job(**pools, policies=[policy(**spec)])
    assert colocated_policies(job.spec, {"agent": transport}, cpu_sets) == colocated
    assert Fleet(job, transport, place_by_resource=False, cpu_sets=cpu_sets).colocated == frozenset()
    assert (
        Fleet(job, transport, place_by_resource=False, cpu_sets=cpu_sets, colocate=True).colocated
        == colocated
    )


LORA = {"lora": {"rank": 4}}
HF = {"uri": "builtin://tiny-qwen2", "dtype": "float32"}


def _lora_policy(name: str, trainer: dict[str, Any] | None) -> dict[str, Any]:
    p = policy(name, model=HF, algorithm=LORA)
    p["rollout"] = {"engine": "torch", **POOLED}
    p["trainer"] = trainer if trainer is not None else p["trainer"]
    return p


ON_POOL = {"pool": "shared", "microBatchSize": 16}


@pytest.mark.parametrize(
    ("trainers", "shared"),
    [
        ((ON_POOL, ON_POOL), True),  # a shared base, both trainers on its pool: one trainer
        ((None, None), False),  # dedicated trainers: one each, on pods of their own
        ((ON_POOL, None), False),
        ((ON_POOL, {**ON_POOL, "ranksPerPod": 2}), False),  # their ranks cannot be the same processes
        ((ON_POOL, {**ON_POOL, "zeroStage": 3}), False),  # ZeRO-3 partitions a base a rank holds whole
    ],
)
def test_which_policies_of_a_shared_base_share_a_trainer(
    trainers: tuple[dict[str, Any] | None, dict[str, Any] | None], shared: bool
) -> None:
    job = make_job(
        pools=[POOL], policies=[_lora_policy(n, t) for n, t in zip(("a", "b"), trainers, strict=True)]
    )
    assert len(job.spec.shared_bases()) == 1  # the engines share the base in every case
    expected = dict.fromkeys(("a", "b"), ("a", "b")) if shared else {}
    assert shared_trainers(job.spec) == expected
    assert Fleet(job, "objectstore", place_by_resource=False).shared_trainers == expected


def test_a_shared_base_on_vllm_gets_one_engine_with_every_adapter() -> None:
    """The engine the fleet would start for a shared base on a GPU pool: vLLM's, holding each policy's
    `algorithm.lora`, receiving through the objectstore transport, on the pool's GPUs (not started)."""
    gpu_pool = {**POOL, "gpus": 1}
    policies = [_lora_policy(n, ON_POOL) for n in ("a", "b")]
    for p, rank in zip(policies, (4, 16), strict=True):
        p["rollout"]["engine"] = "vllm"
        p["algorithm"]["lora"] = {"rank": rank}
    job = make_job(pools=[gpu_pool], policies=policies)
    fleet = Fleet(job, {"a": "objectstore", "b": "objectstore"}, place_by_resource=False)
    engine = fleet._engine(job.spec.policies[0], "a+b-rollout-0")
    assert engine.func.__name__ == "VllmEngine"
    assert {p: lora.rank for p, lora in engine.keywords["adapters"].items()} == {"a": 4, "b": 16}
    assert engine.keywords["transport"] == "objectstore"
    assert (engine.keywords["gpus"], engine.keywords["sleep_mode"]) == (1, True)


def test_every_engine_of_a_policy_starts_from_the_policys_weights() -> None:
    """A built-in model's initial weights come from the policy's seed, the same for each engine
    (a frozen policy's engines never receive others) and its trainer ranks; sampling seeds differ."""
    job = make_job()
    fleet = Fleet(job, "objectstore", place_by_resource=False)
    policy = job.spec.policies[0]
    first, second = fleet._engine(policy, "agent-rollout-0"), fleet._engine(policy, "agent-rollout-1")
    assert (
        first.keywords["model_seed"]
        == second.keywords["model_seed"]
        == policy_seed(job.spec.training.seed, policy.name)
    )
    assert first.keywords["seed"] != second.keywords["seed"]


def _frozen_policy(name: str) -> dict[str, Any]:
    p = policy(name, model=HF, frozen=True)
    p["rollout"] = {"engine": "torch", **POOLED}
    del p["trainer"]
    return p


@pytest.mark.parametrize(
    ("names", "trained_together"),
    [
        (("a", "judge"), ()),  # one LoRA policy: a trainer of its own, the judge none
        (("judge", "a", "b"), ("a", "b")),  # the trained members share one; the judge is no part of it
    ],
)
def test_a_frozen_member_of_a_shared_base_has_no_adapter_and_no_trainer_part(
    names: tuple[str, ...], trained_together: tuple[str, ...]
) -> None:
    """The base's one engine holds an adapter per trained member and serves the frozen one the base
    (`base_policies`), built from the first trained member's rollout and transport whichever member
    asks; the shared trainer, where there is one, trains the LoRA members only."""
    job = make_job(
        pools=[POOL],
        policies=[_frozen_policy(n) if n == "judge" else _lora_policy(n, ON_POOL) for n in names],
    )
    (base,) = job.spec.shared_bases()
    assert (base.policies, base.frozen) == (names, ("judge",))
    expected = dict.fromkeys(trained_together, trained_together)
    assert shared_trainers(job.spec) == expected
    fleet = Fleet(job, {n: "objectstore" for n in names}, place_by_resource=False)
    assert fleet.shared_trainers == expected
    lead = job.spec.policy(base.trained[0])
    engine = fleet._engine(lead, "engine-0")
    assert sorted(engine.keywords["adapters"]) == sorted(base.trained)
    assert engine.keywords["base_policies"] == ("judge",)
    assert engine.args[1] == lead.name
