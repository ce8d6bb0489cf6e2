"""One trainer rank for every policy of a shared base (`SharedBaseRank`): the base held once, one
LoRA adapter per policy (trainers/adapter_engine.py).

Policies that share a base (`RLJobSpec.shared_bases`) and whose trainer ranks run on that pool
(`coordinator.placement.shared_trainers`) get one actor per rank between them instead of one per
policy. Inside it each policy has an `AdapterTrainer`: the DeepSpeed trainer rank's step, loss,
weight sync and checkpoints, over an `AdapterEngine` instead of a DeepSpeed engine.

Every `TrainerRank` method takes the policy first (the fleet hands each policy an
`actors.BoundHandle` that adds its name, so the driver calls a policy's trainer as any other). Calls that read or
change the model run under the shared base's lock with the policy's adapter active: a step of one
policy never sees another's adapter switched in under it. The weight sync's calls do not take it,
so one policy's engines can wait for or receive a version while another policy trains; a policy
publishes its own adapter by name, whichever is active.

One process is one failure domain: if it dies every policy it trains loses its trainer, as with a
node's loss. On a device pool the base moves between host and device memory once for all of them:
the first policy's `offload` moves it, the others' find it moved (a pool's turns are exclusive, so
no policy trains meanwhile), and `restore` brings it back for whichever policy's turn comes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from polyrl_runtime.device_memory import HostBuffers, ParkedMemory
from polyrl_runtime.models import policy_seed
from polyrl_runtime.trainers.adapter_engine import AdapterEngine, SharedBase
from polyrl_runtime.trainers.api import RANK_CONCURRENCY, OffloadReport, TrainerRank, protocol_methods
from polyrl_runtime.trainers.build import Built, learning_rate, set_learning_rate
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer
from polyrl_runtime.trainers.offload import TrainerOffloadedError, offload_rank, restore_rank


class AdapterTrainer(DeepSpeedTrainer):
    """A policy's trainer rank whose model is its adapter on a `SharedBase` (`base()` returns the
    process's one, built by the first policy that sets up)."""

    # Its engine skips a step whose all-reduced gradient is not finite itself (AdapterEngine.step).
    watches_gradients = False

    def __init__(self, *args: Any, base: Callable[[torch.device], SharedBase], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._base = base
        self.adapter_only = True  # its engines hold the base and every policy's adapter
        self.adapter_name = self.spec.name

    def _build(self, device: torch.device) -> Built:
        shared = self._base(device)
        engine = AdapterEngine(shared, self.spec, rank=self.rank, world=self.world)
        set_learning_rate(engine.optimizer, learning_rate(0, self.algo, self.total_steps))
        return Built(engine=engine, ref=None, config={}, hf_config=None, optimizer=engine.optimizer)

    def offload(self) -> OffloadReport:
        raise NotImplementedError("a shared base's rank offloads for all its policies (SharedBaseRank)")

    restore = offload


# The `TrainerRank` calls of the weight sync: they never touch the model's adapters, so they run
# without the lock (a version reaches one policy's engines while another policy trains).
UNLOCKED = frozenset(
    {
        "address",
        "node_id",
        "init_sender",
        "publish_weights",
        "resend_weights",
        "set_weight_receivers",
        "wait_weights",
        "abort_weights",
    }
)
# The calls that need no tensor of the rank's (they may come while it is offloaded).
NO_TENSORS = frozenset(
    {"address", "node_id", "init_sender", "set_weight_receivers", "wait_weights", "abort_weights"}
)


@dataclass(frozen=True)
class BaseState:
    """What a shared rank offloads, shaped as `offload_rank` reads an engine: the model (the base and
    every adapter) with the critics' value heads, and every adapter's and critic's optimizer."""

    module: torch.nn.Module
    optimizer: list[torch.optim.Optimizer]


class SharedBaseRank:
    """One rank of the trainer of several policies sharing one base. `trainers`: per policy, what
    constructs its `AdapterTrainer` given `base=` (the function that returns the shared base);
    `job_seed`: the job's, from which the adapters' initialisation is drawn alike on every rank."""

    def __init__(self, trainers: Mapping[str, Callable[..., AdapterTrainer]], job_seed: int) -> None:
        self._seed = policy_seed(job_seed, "+".join(trainers))
        self._shared: SharedBase | None = None
        self._build_lock = threading.Lock()
        # One policy's setup at a time: the first joins the process group, the others find it joined.
        self._setup_lock = threading.Lock()
        self._trainers = {name: make(base=self._base) for name, make in trainers.items()}
        self._threads = ThreadPoolExecutor(RANK_CONCURRENCY * len(trainers), thread_name_prefix="trainer")
        self._address: tuple[str, int] | None = None
        self._parked: ParkedMemory | None = None
        self._host_buffers = HostBuffers()

    def _base(self, device: torch.device) -> SharedBase:
        with self._build_lock:
            if self._shared is None:
                # Every rank initialises the adapters alike (peft draws them from torch's generator).
                torch.manual_seed(self._seed)
                specs = [t.spec for t in self._trainers.values()]
                cuda = next(iter(self._trainers.values())).cuda
                self._shared = SharedBase.build(specs, seed=self._seed, cuda=cuda, device=device)
            return self._shared

    def _trainer(self, policy: str) -> AdapterTrainer:
        trainer = self._trainers.get(policy)
        if trainer is None:
            raise KeyError(f"this shared trainer rank trains {sorted(self._trainers)}, not {policy!r}")
        return trainer

    async def _run(self, policy: str, name: str, *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer(policy)
        method = getattr(trainer, name)

        def run() -> Any:
            if self._parked is not None and name not in NO_TENSORS:
                raise TrainerOffloadedError(trainer.name, name)
            if name == "setup":
                with self._setup_lock:
                    return method(*args, **kwargs)
            if name in UNLOCKED or self._shared is None:
                return method(*args, **kwargs)
            with self._shared.active(policy):
                return method(*args, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(self._threads, run)

    # -- the calls that are the same for every policy of the base -------------------------------

    async def address(self, policy: str) -> tuple[str, int]:
        """One rendezvous for every policy: the ranks join one process group, whichever policy's
        setup reaches them first."""
        if self._address is None:
            self._address = await self._run(policy, "address")
        return self._address

    async def offload(self, policy: str) -> OffloadReport:
        """The base and every adapter's state to host memory (the other policies' calls find it
        there: a no-op report)."""
        trainer = self._trainer(policy)
        if self._parked is not None or self._shared is None:
            return OffloadReport(trainer.rank, "offload", 0.0, 0)
        parked = await asyncio.get_running_loop().run_in_executor(self._threads, self._offload, trainer)
        return OffloadReport(trainer.rank, "offload", parked.seconds, parked.host_bytes)

    def _offload(self, trainer: AdapterTrainer) -> ParkedMemory:
        assert self._shared is not None
        with self._shared.active(trainer.spec.name):
            for t in self._trainers.values():
                t.begin_weight_update()  # a sender reading the tensors finishes first
            optimizers = [t.engine.optimizer for t in self._trainers.values() if t.engine is not None]
            # A LoRA critic's value adapter is in the base; its head and optimizer are its own.
            critics = [t.critic.engine for t in self._trainers.values() if t.critic is not None]
            modules = torch.nn.ModuleList([self._shared.model, *(c.module for c in critics)])
            state = BaseState(modules, optimizers + [c.optimizer for c in critics])
            self._parked = offload_rank(state, None, trainer.device, self._host_buffers)
            return self._parked

    async def restore(self, policy: str) -> OffloadReport:
        trainer = self._trainer(policy)
        parked = self._parked
        if parked is None:
            return OffloadReport(trainer.rank, "restore", 0.0, 0)
        seconds = await asyncio.get_running_loop().run_in_executor(
            self._threads, restore_rank, parked, trainer.name
        )
        self._parked = None
        return OffloadReport(trainer.rank, "restore", seconds, parked.nbytes)


def _policy_method(name: str) -> Callable[..., Any]:
    own = getattr(DeepSpeedTrainer, name)

    async def method(self: SharedBaseRank, policy: str, *args: Any, **kwargs: Any) -> Any:
        return await self._run(policy, name, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = own.__doc__
    return method


for _name in protocol_methods(TrainerRank):
    if _name not in vars(SharedBaseRank):
        setattr(SharedBaseRank, _name, _policy_method(_name))
