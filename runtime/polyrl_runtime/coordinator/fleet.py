"""The job's actors, placed by custom resources: engines, trainer ranks and workflow workers (and the
experience buffer, on the driver's node). The fleet starts every one of them, so `close` stops them all.

Every actor asks for one unit of `polyrl/<policy>/<role>` (or `polyrl/workflow`), which is what a pod
of that role (or `ray.init(resources=...)` under `polyrl run`) provides, so the same code places actors
on the operator's pods and on one laptop. Engines and workers are elastic: new units (a pod joined)
get a new actor; an actor that died is replaced when its unit is free again; a draining one leaves the
routing tables, finishes its work and is reported drained.

A role on a device pool is placed the same way: a pool pod offers the units of every role that
names the pool (config.node_resources), so a colocated policy's engine and trainer ranks land on
the same pods. How they share the pod's GPUs: `ray_gpus`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import ray
import structlog
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from polyrl_operator.api import Placement, Policy, RLJob
from polyrl_runtime.actors import Actor, ActorClient, BoundHandle, start_actor
from polyrl_runtime.config import resource_name
from polyrl_runtime.coordinator.placement import (
    KEEP_VISIBLE_DEVICES,
    colocated_policies,
    ray_gpus,
    shared_trainers,
)
from polyrl_runtime.coordinator.slots import EngineSlot, Slot, WorkerSlot
from polyrl_runtime.cpusets import cpu_set_key, role_env
from polyrl_runtime.engines.api import Engine
from polyrl_runtime.engines.client import EngineClient
from polyrl_runtime.engines.registry import engine_kind
from polyrl_runtime.experience.actor import create_experience_actor
from polyrl_runtime.experience.buffer import BufferSnapshot, PolicyConfig
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.models import policy_seed
from polyrl_runtime.trainers.api import RANK_CONCURRENCY, TrainerRank
from polyrl_runtime.trainers.client import TrainerRankClient
from polyrl_runtime.workflows.client import WorkflowWorkerClient
from polyrl_runtime.workflows.opponents import OpponentTable

if TYPE_CHECKING:
    from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer
    from polyrl_runtime.trainers.shared_rank import SharedBaseRank

log = structlog.get_logger(__name__)

A = TypeVar("A", bound=Actor)


class Fleet:
    def __init__(
        self,
        job: RLJob,
        transports: Mapping[str, str] | str,
        transport_kwargs: Mapping[str, object] | None = None,
        *,
        place_by_resource: bool = True,
        cpu_sets: Mapping[str, frozenset[int]] | None = None,
        colocate: bool = False,
    ) -> None:
        self.job = job
        self.place_by_resource = place_by_resource
        self.cpu_sets = dict(cpu_sets or {})
        self.spec = job.spec
        # Each policy's weight transport (a policy on one pod may use one the others cannot).
        self.transports = (
            {p.name: transports for p in self.spec.policies}
            if isinstance(transports, str)
            else dict(transports)
        )
        self.transport_kwargs = dict(transport_kwargs or {})
        # Policies whose first engine runs in their trainer rank's process (`polyrl run`).
        self.colocated = (
            colocated_policies(job.spec, self.transports, self.cpu_sets) if colocate else frozenset()
        )
        # Policies whose trainer ranks are one actor per rank for their shared base (`shared_trainers`),
        # its handles once the first of them started it, and one step at a time per such trainer.
        self.shared_trainers = shared_trainers(job.spec)
        self._shared_ranks: dict[tuple[str, ...], list[ActorHandle[SharedBaseRank]]] = {}
        self._step_locks = {g: asyncio.Lock() for g in set(self.shared_trainers.values())}
        self.engines: dict[str, dict[str, EngineSlot]] = {p.name: {} for p in self.spec.policies}
        self.workers: dict[str, WorkerSlot] = {}
        self._started: list[Actor] = []  # every actor started, for `close`
        self._ids = itertools.count()
        self.routes_epoch = 0  # bumped by each push of routing tables to the workers
        # Per league policy, what the workers draw opponents from (coordinator/league.py).
        self.opponent_tables: dict[str, OpponentTable] = {}
        # Without placement resources (tests on a plain Ray), what Ray's resource accounting does
        # otherwise: a dead actor's unit is free again, for housekeeping to start a replacement on.
        self._vacated: Counter[tuple[str | None, str]] = Counter()

    # -- creation ------------------------------------------------------------------------------

    def _res(self, policy: str | None, role: str) -> dict[str, float]:
        return {resource_name(policy, role): 1} if self.place_by_resource else {}

    def _env(self, role: str, placement: Placement | None = None) -> dict[str, str]:
        """What the actor's environment adds to its node's: its CPU set (its pool's when it runs on
        one) and, on a pool with GPUs, the pod's devices left visible (`ray_gpus`). Everything else
        comes from the node, as it does for a process the node starts: in a pod the pod's own
        environment (its role's `env`, the pod contract's directories), in `polyrl run` the driver's,
        which the local Ray inherited."""
        pool = placement.pool if placement is not None else None
        env = role_env(self.cpu_sets, cpu_set_key(role, pool))
        if placement is not None and pool is not None and placement.gpus > 0:
            env.update(KEEP_VISIBLE_DEVICES)
        return env

    def _runtime_env(self, role: str, placement: Placement | None = None) -> dict[str, Any]:
        """The actor option that sets `_env`, or none when it is empty: any runtime_env starts the
        actor's worker through Ray's setup_worker.py, one more interpreter (about 0.5 s of CPU)."""
        env = self._env(role, placement)
        return {"runtime_env": {"env_vars": env}} if env else {}

    def _track(self, actor: A) -> A:
        self._started.append(actor)
        return actor

    def new_buffer(
        self, policies: Sequence[PolicyConfig], capacity: int, snapshot: BufferSnapshot | None
    ) -> BufferClient:
        """The job's experience buffer, restored from `snapshot` if given, on this (the driver's) node."""
        node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        handle = create_experience_actor(policies, capacity, snapshot=snapshot, scheduling_strategy=node)
        return self._track(BufferClient(handle))

    def start_policy(self, policy: Policy, buffer: BufferClient) -> list[TrainerRankClient]:
        """The policy's trainer ranks, and its engines up to the rollout's minimum (a policy sharing a
        base has them once an earlier policy of that base started them). A colocated policy
        (`colocated_policies`) has its first engine in its trainer rank's process. A frozen policy
        (`trainer: null`) has its engines only."""
        ranks = [self._new_colocated(policy, buffer)] if policy.name in self.colocated else None
        for _ in range(
            self.spec.rollout_placement(policy).min_replicas - len(self.live_engines(policy.name))
        ):
            self.new_engine(policy)
        if policy.frozen:
            return []
        return ranks if ranks is not None else self.new_trainers(policy, buffer)

    def new_engine(self, policy: Policy) -> EngineSlot:
        """An engine for `policy`: its own, or, for a policy that shares a base (`spec.shared_bases`),
        one engine for every policy of that base, taking a unit of each one's rollout resource on its
        pod and listed under each of them. A shared base's engine is the first trained member's
        rollout, whichever member asks for it (a frozen member's engine settings agree with it)."""
        shared = self.spec.shared_base(policy.name)
        members = shared.policies if shared is not None else (policy.name,)
        if shared is not None:
            policy = self.spec.policy(shared.trained[0])
        name = f"{'+'.join(members) if shared is not None else policy.name}-rollout-{next(self._ids)}"
        placement = self.spec.rollout_placement(policy)
        resources: dict[str, float] = {}
        for member in members:
            resources.update(self._res(member, "rollout"))
        options = {
            "resources": resources,
            "num_cpus": 0,
            "num_gpus": ray_gpus(placement, placement.gpus),
            "max_concurrency": 4096,
            **self._runtime_env("rollout", placement),
        }
        engine = self._engine(policy, name)
        handle: ActorHandle[Engine] = start_actor(engine.func, options, *engine.args, **engine.keywords)
        return self._add_engine(name, EngineClient(handle), policy, members if shared is not None else ())

    def _engine(self, policy: Policy, name: str) -> functools.partial[Engine]:
        """An engine of the policy's rollout (or of its shared base), to be constructed (as an actor of
        its own, or in a `ColocatedRank`). Its seed: the job's, plus the fleet's count so far. On a
        shared base: an adapter per trained member, and the frozen members served the base alone
        (`base_policies`). A policy with a league has its adapter on an engine of its own."""
        shared = self.spec.shared_base(policy.name)
        adapters = (
            {m: self.spec.policy(m).algorithm.lora for m in shared.trained} if shared is not None else {}
        )
        if shared is None and policy.league is not None and policy.algorithm.lora is not None:
            adapters = {policy.name: policy.algorithm.lora}  # its snapshots are copies of its adapter
        base_policies = shared.frozen if shared is not None else ()
        kind = engine_kind(policy.rollout.engine)
        cls: Callable[..., Engine] = kind.load()  # every engine class takes these (engines/registry.py)
        return functools.partial(
            cls,
            name,
            policy.name,
            policy.model.uri,
            transport=self.transports[policy.name],
            transport_kwargs=self.transport_kwargs,
            seed=self.spec.training.seed + next(self._ids),
            model_seed=policy_seed(self.spec.training.seed, policy.name),
            dtype=policy.model.dtype,
            trust_remote_code=policy.model.trust_remote_code,
            **kind.options(self.spec, policy),
            **({"adapters": adapters} if adapters else {}),
            **({"base_policies": base_policies} if base_policies else {}),
        )

    def _add_engine(
        self, name: str, client: EngineClient, policy: Policy, shared_by: tuple[str, ...]
    ) -> EngineSlot:
        slot = Slot(name, self._track(client), policy=policy.name, shared_by=shared_by)
        for member in shared_by or (policy.name,):
            self._refill(member, "rollout")
            self.engines[member][name] = slot
        return slot

    def _new_colocated(self, policy: Policy, buffer: BufferClient) -> TrainerRankClient:
        """The policy's one trainer rank with its first engine in the same actor (trainers/colocated.py):
        one unit of each role's resource, the trainer's environment."""
        from polyrl_runtime.trainers.build import rank_layout
        from polyrl_runtime.trainers.colocated import ColocatedRank

        name = f"{policy.name}-rollout-{next(self._ids)}"
        (slot,) = rank_layout(1, 1)
        options = {
            "resources": {**self._res(policy.name, "rollout"), **self._res(policy.name, "trainer")},
            "num_cpus": 0,
            "max_concurrency": 4096,
            **self._runtime_env("trainer", self.spec.trainer_placement(policy)),
        }
        handle = start_actor(
            ColocatedRank,
            options,
            self._engine(policy, name),
            self._trainer(policy, slot.rank, slot.world, buffer),
        )
        # One actor answering both roles' methods (tested), so each role's client calls it.
        engine: ActorHandle[Engine] = cast("ActorHandle[Engine]", handle)
        rank: ActorHandle[TrainerRank] = cast("ActorHandle[TrainerRank]", handle)
        self._add_engine(name, EngineClient(engine), policy, ())
        return TrainerRankClient(rank)

    def new_worker(self, job_json: str, buffer: BufferClient) -> WorkerSlot:
        from polyrl_runtime.workflows.runner import WorkflowWorker

        name = f"workflow-{next(self._ids)}"
        options = {
            "resources": self._res(None, "workflow"),
            "num_cpus": 0,
            "max_concurrency": 4096,
            **self._runtime_env("workflow"),
        }
        handle = start_actor(
            WorkflowWorker,
            options,
            name,
            job_json,
            buffer,
            self.routes(),
            routes_epoch=self.routes_epoch,
            opponent_tables=self.opponent_tables,
        )
        slot = Slot(name, self._track(WorkflowWorkerClient(handle)))
        self.workers[name] = slot
        self._refill(None, "workflow")
        return slot

    def new_trainers(self, policy: Policy, buffer: BufferClient) -> list[TrainerRankClient]:
        """Every rank of the policy's trainer: `ranks_per_pod` on each of its pods (one per GPU), each
        rank one unit of the pod's trainer resource and, on GPU, one GPU of its own (on a pool, the
        pod's GPU of its node-local index: `ray_gpus`)."""
        from polyrl_runtime.trainers.build import rank_layout

        group = self.shared_trainers.get(policy.name)
        if group is not None:
            return self._shared_trainer(policy, group, buffer)
        placement = self.spec.trainer_placement(policy)
        options = {
            "resources": self._res(policy.name, "trainer"),
            "num_cpus": 0,
            "num_gpus": ray_gpus(placement, 1),
            "max_concurrency": RANK_CONCURRENCY,
            **self._runtime_env("trainer", placement),
        }
        ranks: list[TrainerRankClient] = []
        for slot in rank_layout(placement.min_replicas, placement.ranks_per_pod):
            trainer = self._trainer(policy, slot.rank, slot.world, buffer)
            handle: ActorHandle[TrainerRank] = start_actor(
                trainer.func, options, *trainer.args, **trainer.keywords
            )
            ranks.append(self._track(TrainerRankClient(handle)))
        return ranks

    def _shared_trainer(
        self, policy: Policy, group: tuple[str, ...], buffer: BufferClient
    ) -> list[TrainerRankClient]:
        """`policy`'s ranks of the trainer its shared base's policies have in common
        (trainers/shared_rank.py), started by the first of them: a rank is one unit of each member's
        trainer resource (a pool pod offers them all), and each policy calls it through a handle
        that names the policy."""
        from polyrl_runtime.trainers.build import rank_layout
        from polyrl_runtime.trainers.shared_rank import AdapterTrainer, SharedBaseRank

        handles = self._shared_ranks.get(group)
        if handles is None:
            placement = self.spec.trainer_placement(policy)
            options = {
                "resources": {k: v for m in group for k, v in self._res(m, "trainer").items()},
                "num_cpus": 0,
                "num_gpus": ray_gpus(placement, 1),
                "max_concurrency": RANK_CONCURRENCY * len(group),
                **self._runtime_env("trainer", placement),
            }
            members = [self.spec.policy(m) for m in group]
            handles = []
            for slot in rank_layout(placement.min_replicas, placement.ranks_per_pod):
                trainers = {
                    m.name: cast(
                        "Callable[..., AdapterTrainer]",
                        self._trainer(m, slot.rank, slot.world, buffer, AdapterTrainer),
                    )
                    for m in members
                }
                handle = start_actor(SharedBaseRank, options, trainers, self.spec.training.seed)
                self._track(ActorClient(handle))
                handles.append(handle)
            self._shared_ranks[group] = handles
            log.info("trainer.shared", policies=list(group), ranks=len(handles))
        bound = [cast("ActorHandle[TrainerRank]", BoundHandle(h, policy.name)) for h in handles]
        return [TrainerRankClient(h) for h in bound]

    def step_lock(self, policy: str) -> asyncio.Lock:
        """Held for a training step of `policy`: shared by the policies of one shared trainer (their
        ranks' collectives must not interleave), else the policy's own."""
        group = self.shared_trainers.get(policy, (policy,))
        if group not in self._step_locks:
            self._step_locks[group] = asyncio.Lock()
        return self._step_locks[group]

    def _trainer(
        self,
        policy: Policy,
        rank: int,
        world: int,
        buffer: BufferClient,
        cls: type[DeepSpeedTrainer] | None = None,
    ) -> functools.partial[DeepSpeedTrainer]:
        """A trainer rank (a `DeepSpeedTrainer` unless `cls` says), to be constructed: as an actor of
        its own, in a `ColocatedRank` or in a `SharedBaseRank`."""
        from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer

        return functools.partial(
            cls or DeepSpeedTrainer,
            f"{policy.name}-trainer-{rank}",
            policy.model_dump_json(by_alias=True),
            self.spec.training.seed,
            rank=rank,
            world=world,
            buffer=buffer,
            temperature=policy.rollout.sampling.temperature,
            total_steps=self.spec.training.total_steps,
            gpus=self.spec.trainer_placement(policy).gpus,
            adapter_only=self.spec.served_as_adapter(policy.name),
            teacher_json=(
                self.spec.policy(d.teacher).model_dump_json(by_alias=True)
                if (d := policy.algorithm.distillation) is not None
                else None
            ),
        )

    def close(self) -> None:
        """Stop every actor this fleet started (idempotent: one already gone is skipped)."""
        for actor in self._started:
            with contextlib.suppress(Exception):
                actor.kill()

    # -- routing, health, drain ----------------------------------------------------------------

    def live_engines(self, policy: str) -> dict[str, EngineSlot]:
        return {n: s for n, s in self.engines[policy].items() if not s.dead}

    def routes(self) -> dict[str, dict[str, EngineClient]]:
        """policy -> {engine name: engine}: where the workflow workers may send new requests."""
        return {
            p: {n: s.actor for n, s in slots.items() if not s.dead and not s.draining}
            for p, slots in self.engines.items()
        }

    async def set_opponents(self, tables: dict[str, OpponentTable]) -> None:
        """Install the league's opponent tables on every live worker (and the workers started later)."""
        self.opponent_tables = tables
        live = [w for w in self.workers.values() if not w.dead]
        await asyncio.gather(*(w.actor.set_opponents(tables) for w in live), return_exceptions=True)

    async def push_routes(self) -> None:
        self.routes_epoch += 1
        for s in (s for p in self.engines.values() for s in p.values() if s.draining and s.fence is None):
            s.fence = self.routes_epoch
        routes, epoch = self.routes(), self.routes_epoch
        live = [w for w in self.workers.values() if not w.dead]
        await asyncio.gather(*(w.actor.set_routes(routes, epoch) for w in live), return_exceptions=True)

    async def poll(self) -> list[Slot[Actor]]:
        """Refresh stats of every engine and worker; returns the slots found dead since the last poll."""
        newly_dead: list[Slot[Actor]] = []
        # Once each: an engine of a shared base is listed under every policy it serves.
        slots = list({id(s): s for p in self.engines.values() for s in p.values() if not s.dead}.values())
        results = await asyncio.gather(*(s.actor.stats() for s in slots), return_exceptions=True)
        for s, r in zip(slots, results, strict=True):
            if s.dead:  # marked while the stats were awaited (a sync or a worker saw it die): reported there
                continue
            if isinstance(r, BaseException):
                self._died(s)
                newly_dead.append(s)
                continue
            s.observe(r.busy_s, r.in_flight)
            s.queued, s.version = r.queued, r.version
            s.aborted, s.freed_tokens = r.aborted, r.freed_tokens
            s.pod = s.pod or str(r.extra.get("pod", "")) or s.name
        workers = [w for w in self.workers.values() if not w.dead]
        outstanding: Counter[str] = Counter()  # engine -> requests the workers are waiting on
        oldest = self.routes_epoch  # the oldest routes a live worker holds
        wres = await asyncio.gather(*(w.actor.stats() for w in workers), return_exceptions=True)
        for w, ws in zip(workers, wres, strict=True):
            if w.dead:  # as above: the producer saw it die first
                continue
            if isinstance(ws, BaseException):
                self._died(w)
                newly_dead.append(w)
                continue
            w.observe(ws.busy_s, ws.in_flight)
            w.pod = w.pod or ws.pod or w.name
            outstanding.update(ws.engine_requests)
            oldest = min(oldest, ws.routes_epoch)
        for s in slots:
            s.quiet = s.fence is not None and oldest >= s.fence and not outstanding[s.name]
        return newly_dead

    def mark_dead(self, names: set[str]) -> list[EngineSlot]:
        """Engines found dead elsewhere (a sync, a worker); returns those not marked before."""
        out = []
        for p in self.engines.values():
            for n in names & set(p):
                if not p[n].dead:
                    self._died(p[n])
                    out.append(p[n])
        return out

    def mark_worker_dead(self, worker: WorkerSlot) -> bool:
        """A workflow worker's call failed because its actor died; True the first time."""
        if worker.dead:
            return False
        self._died(worker)
        return True

    def _died(self, slot: Slot[Actor]) -> None:
        slot.dead = True
        if not self.place_by_resource:
            for policy in slot.shared_by or (slot.policy or None,):
                self._vacated[(policy, "rollout" if policy else "workflow")] += 1

    def _refill(self, policy: str | None, role: str) -> None:
        if self._vacated[(policy, role)] > 0:
            self._vacated[(policy, role)] -= 1

    def set_draining(self, target: str, draining: bool) -> bool:
        """Drain (or undrain) the engine or worker named `target` (actor name or pod name)."""
        found = False
        for s in [*(s for p in self.engines.values() for s in p.values()), *self.workers.values()]:
            if target in (s.name, s.pod):
                s.draining = draining
                s.fence, s.quiet = None, False  # until new routes are out and a poll saw it idle
                found = True
        return found

    def free_units(self, policy: str | None, role: str) -> int:
        """Units of the role's placement resource with no actor on them: a pod that joined (or came
        back), or a dead actor's."""
        if not self.place_by_resource:
            return self._vacated[(policy, role)]
        api: Any = ray
        return int(api.available_resources().get(resource_name(policy, role), 0))
