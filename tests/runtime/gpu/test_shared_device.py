"""Two policies share one device through the pool scheduler (coordinator/pool_scheduler.py), in bf16:
each round both engines generate, then each policy in turn has the device to itself (the other
policy's trainer state and every engine's weights off it), trains the tiny model on its samples and
updates its engine, whose weights then equal the trainer's bit for bit.

The roles run in-process (no Ray, no DeepSpeed: a torch AdamW rank goes through the same offload
walk as a DeepSpeed one, trainers/offload.py). On CUDA the update goes through device-memory handles
(`cudaipc`), on CPU through shared memory; the CPU row is a `make test` test, the CUDA row the `gpu`
tier's. Figures (test properties): tokens/s generated, switch seconds against step seconds, the
device's peak bytes in a turn against what every role would hold at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from polyrl_runtime.coordinator.pool_scheduler import PoolRoles, PoolScheduler
from polyrl_runtime.device_memory import ParkedMemory
from polyrl_runtime.engines.api import Generation, SamplingParams
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.models import load_model
from polyrl_runtime.trainers.offload import offload_rank, restore_rank
from polyrl_runtime.weights import make_sender

POLICIES = ("solver", "verifier")
PROMPTS = [[1, 10 + i, 11, 12] for i in range(8)]
ROUNDS = 3
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
)


def _gone(tensors: Any) -> bool:
    """Whether every tensor's memory is parked (its storage resized to nothing)."""
    return all(t.untyped_storage().size() == 0 for t in tensors)


async def _done(value: object) -> object:
    return value


class Trainer:
    """One policy's trainer rank in-process: the model and AdamW, offloaded between turns."""

    def __init__(self, uri: str, device: torch.device) -> None:
        self.device = device
        self.model = load_model(uri, dtype="bfloat16", cuda=device.type == "cuda").to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.0)
        self.rank = SimpleNamespace(module=self.model, optimizer=self.opt)
        self.parked: ParkedMemory | None = None
        self.state_bytes = 0

    def offload(self) -> Awaitable[object]:
        self.parked = offload_rank(self.rank, None, self.device)
        self.state_bytes = max(self.state_bytes, self.parked.nbytes)
        return _done(self.parked.nbytes)

    def restore(self) -> Awaitable[object]:
        assert self.parked is not None
        seconds = restore_rank(self.parked, "test")
        self.parked = None
        return _done(seconds)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: p.data for k, p in self.model.named_parameters()}

    def train(self, gens: list[Generation]) -> float:
        """REINFORCE on the generated tokens, rewarded for even token ids (a signal the tiny model
        can follow): the step changes the weights through bf16 autograd and AdamW."""
        self.opt.zero_grad(set_to_none=False)
        rewards = torch.tensor([float((g.token_ids % 2 == 0).mean()) for g in gens], device=self.device)
        advantages = rewards - rewards.mean()
        total = torch.zeros((), device=self.device)
        for prompt, g, adv in zip(PROMPTS, gens, advantages, strict=True):
            ids = torch.tensor([*prompt, *g.token_ids.tolist()], device=self.device)
            logits = self.model(input_ids=ids[None]).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits, -1).gather(1, ids[len(prompt) :, None]).sum()
            total = total - adv * logp / len(gens)
        total.backward()
        self.opt.step()
        return float(total.detach())


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_two_policies_take_turns_on_one_device(
    varied_qwen2: Path, device: str, record_property: Callable[[str, object], None]
) -> None:
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    uri = f"file://{varied_qwen2}"
    transport = "cudaipc" if device == "cuda" else "shm"
    engines = {
        p: TorchEngine(f"{p}-0", p, uri, transport=transport, seed=i, device=device, dtype="bfloat16")
        for i, p in enumerate(POLICIES)
    }
    trainers = {p: Trainer(uri, dev) for p in POLICIES}
    senders = {p: make_sender(transport, p, 1 << 22) for p in POLICIES}
    sched = PoolScheduler(
        PoolRoles("shared", POLICIES, POLICIES), lambda p: [engines[p]], lambda p: [trainers[p]]
    )
    engine_bytes = {p: sum(t.nbytes for t in e.target.named_tensors().values()) for p, e in engines.items()}
    cuda = dev.type == "cuda"
    peaks: list[int] = []
    tokens, gen_s, step_s = 0, 0.0, 0.0

    async def turn(p: str, version: int, gens: list[Generation]) -> None:
        nonlocal step_s
        start = time.perf_counter()
        async with sched.turn(p) as t:
            q = next(o for o in POLICIES if o != p)
            assert _gone(trainers[q].tensors().values())  # the other trainer is in host memory
            if cuda:  # a CPU engine's weights stay in host memory when it sleeps
                assert _gone(engines[q].target.named_tensors().values())
                assert _gone(engines[p].target.named_tensors().values())
            trainers[p].train(gens)
            await t.wake_own_engines()
            report = await engines[p].receive_weights(senders[p].publish(version, trainers[p].tensors()))
            assert report.applied and engines[p].target.version == version
            own = engines[p].target.named_tensors()
            for name, w in trainers[p].tensors().items():
                assert torch.equal(own[name], w), name  # the engine serves what the trainer trained
            if cuda:
                torch.cuda.synchronize(dev)
                peaks.append(torch.cuda.max_memory_allocated(dev))
        step_s += time.perf_counter() - start

    async def run() -> None:
        nonlocal tokens, gen_s
        for p in POLICIES:  # version 0: the trainers' initial weights, then between turns off the device
            await engines[p].receive_weights(senders[p].publish(0, trainers[p].tensors()))
        await sched.park_trainers()
        for version in range(1, ROUNDS + 1):
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            start = time.perf_counter()
            gens = {
                p: list(
                    await asyncio.gather(
                        *(
                            engines[p].generate(
                                ids, SamplingParams(max_new_tokens=16, seed=version * 100 + i)
                            )
                            for i, ids in enumerate(PROMPTS)
                        )
                    )
                )
                for p in POLICIES
            }
            gen_s += time.perf_counter() - start
            tokens += sum(len(g.token_ids) for gs in gens.values() for g in gs)
            await asyncio.gather(*(turn(p, version, gens[p]) for p in POLICIES))

    try:
        asyncio.run(run())
    finally:
        for s in senders.values():
            s.close()
    usage = sched.usage
    assert usage.turns == dict.fromkeys(POLICIES, ROUNDS)
    # Each round: engines -> solver's trainer -> verifier's trainer -> engines.
    assert usage.switches == 3 * ROUNDS
    record_property("tokens_per_s", round(tokens / gen_s, 1))
    record_property("switch_s", round(usage.switch_s, 4))
    record_property("switch_fraction_of_steps", round(usage.switch_s / step_s, 4))
    if cuda:
        everything = sum(t.state_bytes for t in trainers.values()) + sum(engine_bytes.values())
        record_property("turn_peak_bytes", max(peaks))
        record_property("all_resident_bytes", everything)
