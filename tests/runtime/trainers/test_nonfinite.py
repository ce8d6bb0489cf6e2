"""A non-finite loss or gradient skips the optimizer step (trainers/nonfinite.py): the weights and the
optimizer state stay bit for bit what they were, the step is counted, the version still advances,
and the next step trains. For a DeepSpeed rank (CPU, gloo, world 1) at every ZeRO stage, with and
without gradient accumulation, under grpo and ppo; for the adapter engine of a shared base
(LoRA without DeepSpeed); and for two ranks that must skip together when only one of them saw it.

Two ways in: an infinite reward injected into the batch the rank pulls (its advantages and so its
loss and gradient are NaN), and a NaN put into the gradient by the backward alone, the loss staying
finite (what a loss check cannot see, and what DeepSpeed's ZeRO stage 0 in fp32 would apply)."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.experience import Episode, SampleBatch, Turn
from polyrl_runtime.experience.state import Lease
from polyrl_runtime.netmap import free_port
from polyrl_runtime.trainers import deepspeed_trainer
from polyrl_runtime.trainers.adapter_engine import AdapterEngine, SharedBase
from polyrl_runtime.trainers.build import build_trainer
from polyrl_runtime.trainers.nonfinite import GradientWatch, StepGuard, suppressed_step
from polyrl_runtime.trainers.shared_rank import AdapterTrainer
from polyrl_testenv.trainer_rank import in_process_rank

CPU = torch.device("cpu")
N_SAMPLES = 4
WORKER = Path(__file__).with_name("nonfinite_ranks.py")
SUPPORT = Path(__file__).parents[2] / "support"


class _NaNGradient(torch.autograd.Function):
    """The identity forward; a NaN gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.nan


def _policy(uri: str, *, stage: int = 0, micro: int = N_SAMPLES, **algorithm: Any) -> Policy:
    return Policy.model_validate(
        {
            "name": "agent",
            "model": {"uri": uri, "dtype": "float32"},
            "algorithm": {"lr": 1e-2, **algorithm},
            "rollout": {"engine": "torch", "gpus": 0},
            "trainer": {"gpus": 0, "zeroStage": stage, "microBatchSize": micro},
        }
    )


def _batch(seed: int) -> SampleBatch:
    """Four one-turn episodes (builtin://tiny's vocabulary), rewards 0 and 1, as a lease delivers them."""
    rng = np.random.default_rng(seed)
    episodes = [
        Episode(
            f"e{seed}-{i}",
            (
                Turn(
                    "agent",
                    "agent",
                    rng.integers(3, 60, 4).astype(np.int32),
                    rng.integers(3, 60, 5).astype(np.int32),
                    np.full(5, -2.0, np.float32),
                    np.zeros(5, np.int32),
                ),
            ),
            {"agent": float(i % 2)},
        )
        for i in range(N_SAMPLES)
    ]
    batch = SampleBatch.from_samples("agent", [s for e in episodes for s in e.samples()])
    back = pickle.loads(pickle.dumps(batch))
    assert isinstance(back, SampleBatch)
    return back


class _Leases:
    """A buffer that hands the rank the batches it is given, one lease each (its `pull` result stands
    in for the object ref)."""

    def __init__(self) -> None:
        self.batches: list[SampleBatch] = []
        self.next_id = 0

    def pull(self, policy: str, consumer: str, max_samples: int, timeout: float) -> Lease:
        self.next_id += 1
        return Lease(self.next_id, "agent", consumer, self.batches.pop(0))


@pytest.fixture
def direct_leases(gloo: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Leases]:
    monkeypatch.setattr(deepspeed_trainer, "ray", SimpleNamespace(get=lambda ref: ref))
    yield _Leases()


def _torch_optimizer(engine: Any) -> torch.optim.Optimizer:
    opt: Any = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


def _state(engine: Any) -> dict[str, torch.Tensor]:
    """The trained state, by name: the parameters (ZeRO-3: this rank's shards), the optimizer's own
    parameters (ZeRO's fp32 partitions) and its state of each (exp_avg, exp_avg_sq, step)."""
    out = {}
    for name, p in engine.module.named_parameters():
        shard: Any = getattr(p, "ds_tensor", None)
        out[f"param {name}"] = (shard if shard is not None else p.data).detach().clone()
    opt = _torch_optimizer(engine)
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        out[f"master {i}"] = p.detach().clone()
        for key, value in opt.state[p].items():
            out[f"optimizer {i} {key}"] = (
                value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
            )
    return out


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The entries that differ in any bit (NaN == NaN)."""
    assert a.keys() == b.keys()
    return [
        k
        for k in a
        if not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
    ]


def _finite(state: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t.float()).all()) for t in state.values())


def _nan_gradient_in_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank's logprobs get a NaN gradient; their values (so the loss) stay finite."""
    real = deepspeed_trainer.sequence_logprobs_and_entropy

    def scored(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logp, entropy = real(*args, **kwargs)
        return _NaNGradient.apply(logp), entropy

    monkeypatch.setattr(deepspeed_trainer, "sequence_logprobs_and_entropy", scored)


# -- a DeepSpeed rank's training step --------------------------------------------------------------


@pytest.mark.parametrize("inject", ["inf-reward", "nan-gradient"])
@pytest.mark.parametrize(
    ("stage", "micro"),
    [(0, N_SAMPLES), (0, 2), (1, N_SAMPLES), (2, 2), (3, N_SAMPLES), (3, 2)],
    ids=["zero0", "zero0-accumulated", "zero1", "zero2-accumulated", "zero3", "zero3-accumulated"],
)
def test_a_non_finite_step_is_skipped_and_the_next_one_trains(
    direct_leases: _Leases,
    monkeypatch: pytest.MonkeyPatch,
    stage: int,
    micro: int,
    inject: str,
) -> None:
    rank = in_process_rank(_policy("builtin://tiny", stage=stage, micro=micro))
    rank.buffer = direct_leases  # type: ignore[assignment]
    direct_leases.batches = [_batch(1), _batch(2), _batch(3)]
    first = rank.train_step(1, N_SAMPLES, N_SAMPLES // micro)
    assert first.skipped_nonfinite == 0 and math.isfinite(first.grad_norm)
    before = _state(rank.engine)
    counters = (rank.engine.global_steps, rank.engine.micro_steps)

    if inject == "inf-reward":
        direct_leases.batches[0].rewards[0] = np.inf
    with monkeypatch.context() as patch:
        if inject == "nan-gradient":
            _nan_gradient_in_backward(patch)
        skipped = rank.train_step(2, N_SAMPLES, N_SAMPLES // micro)
    assert skipped.skipped_nonfinite == 1
    assert not math.isfinite(skipped.grad_norm)  # reported as it was, not as 0.0
    if inject == "nan-gradient":
        assert math.isfinite(skipped.loss)  # only the gradient was NaN
    after = _state(rank.engine)
    assert not _changed(before, after) and _finite(after)
    assert rank.version == 2  # the step happened; it trained nothing
    # DeepSpeed's boundary ran as for any step: its counters advanced, the next step is a normal one.
    assert rank.engine.global_steps == counters[0] + 1
    assert rank.engine.micro_steps == counters[1] + N_SAMPLES // micro

    trained = rank.train_step(3, N_SAMPLES, N_SAMPLES // micro)
    assert trained.skipped_nonfinite == 0 and math.isfinite(trained.grad_norm)
    changed = _changed(after, _state(rank.engine))
    assert any(k.startswith("param ") for k in changed) and _finite(_state(rank.engine))


def test_ppo_skips_only_the_micro_batch_whose_gradient_is_not_finite(
    gloo: None, direct_leases: _Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ppo takes one optimizer step per micro-batch: the first, with the NaN, is skipped; the second
    trains."""
    rank = in_process_rank(_policy("builtin://tiny", micro=2, name="ppo"))
    rank.buffer = direct_leases  # type: ignore[assignment]
    direct_leases.batches = [_batch(1)]
    real = deepspeed_trainer.sequence_logprobs_and_entropy
    calls = []

    def first_nan(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logp, entropy = real(*args, **kwargs)
        calls.append(1)
        return (_NaNGradient.apply(logp) if len(calls) == 1 else logp), entropy

    monkeypatch.setattr(deepspeed_trainer, "sequence_logprobs_and_entropy", first_nan)
    before = {n: p.detach().clone() for n, p in rank.engine.module.named_parameters()}
    result = rank.train_step(1, N_SAMPLES, 2)
    assert len(calls) == 2 and result.skipped_nonfinite == 1
    assert math.isfinite(result.grad_norm)  # the last optimizer step's: the second, not skipped
    after = _state(rank.engine)
    assert _finite(after)
    assert any(not torch.equal(t, after[f"param {n}"]) for n, t in before.items())  # the second trained
    steps = {float(t) for k, t in after.items() if k.endswith(" step")}
    assert steps == {1.0}  # and only the second: AdamW counted one step of each parameter


# -- the guard itself -------------------------------------------------------------------------------


def _loss(engine: Any, nan_gradient: bool = False) -> torch.Tensor:
    ids = torch.tensor([[5, 17, 59, 3, 25, 41, 7, 12], [9, 8, 7, 6, 5, 4, 3, 2]])
    out = engine(input_ids=ids)  # builtin://tiny returns the logits themselves
    logits = getattr(out, "logits", out).float()
    if nan_gradient:
        logits = _NaNGradient.apply(logits)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_watch_sees_each_local_gradient_before_zero_reduces_it(gloo: None, stage: int) -> None:
    """Under ZeRO-2/3 `.grad` is gone after the backward; the watch has seen every gradient anyway,
    so the decision never rests on DeepSpeed's own checks."""
    built = build_trainer(
        _policy("builtin://tiny", stage=stage), seed=1, cuda=False, device=CPU, total_steps=2
    )
    watch = GradientWatch(built.engine.module.parameters())
    built.engine.backward(_loss(built.engine))
    finite = watch.total()
    assert math.isfinite(finite) and finite > 0
    built.engine.step()
    watch.reset()
    built.engine.backward(_loss(built.engine, nan_gradient=True))
    assert math.isnan(watch.total())
    watch.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_skip_decided_by_the_guard_alone_changes_nothing(gloo: None, stage: int) -> None:
    """A non-finite loss with finite gradients: DeepSpeed would apply them (it checks gradients
    only), so the suppressed optimizer step is all that keeps the state as it was."""
    built = build_trainer(
        _policy("builtin://tiny", stage=stage), seed=1, cuda=False, device=CPU, total_steps=2
    )
    engine = built.engine
    assert built.optimizer is _torch_optimizer(engine)  # the optimizer whose step writes the weights
    guard = StepGuard(
        engine,
        built.optimizer,
        watch=GradientWatch(engine.module.parameters()),
        loss_scaled=False,
        allreduce=lambda values: values,
    )
    engine.backward(_loss(engine))
    guard.step()
    before = _state(engine)
    guard.begin()
    engine.backward(_loss(engine))
    guard.loss(math.nan)
    guard.step()
    assert guard.skipped == 1 and engine.skipped_steps == 0  # DeepSpeed saw nothing wrong
    assert not _changed(before, _state(engine))
    guard.begin()
    engine.backward(_loss(engine))
    guard.step()
    assert guard.skipped == 0 and _changed(before, _state(engine))


def test_a_suppressed_step_leaves_the_optimizer_as_it_was() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    with suppressed_step(opt):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and not opt.state
    opt.step()  # the class's own step again
    assert not torch.equal(p.detach(), torch.ones(3)) and opt.state


# -- the adapter engine (LoRA on a shared base, no DeepSpeed) --------------------------------------


def _lora_policy(model_dir: Path, micro: int = N_SAMPLES) -> Policy:
    return Policy.model_validate(
        {
            "name": "agent",
            "model": {"uri": f"file://{model_dir}", "dtype": "float32"},
            "algorithm": {"lr": 1e-2, "lora": {"rank": 4, "alpha": 8}},
            "rollout": {"engine": "torch", "gpus": 0},
            "trainer": {"gpus": 0, "microBatchSize": micro},
        }
    )


def _adapter_state(engine: AdapterEngine) -> dict[str, torch.Tensor]:
    out = {f"adapter {n}": t for n, t in engine.adapter_state().items()}
    for i, p in enumerate(engine.params):
        for key, value in engine.optimizer.state[p].items():
            out[f"optimizer {i} {key}"] = value.clone()
    return out


def test_the_adapter_engine_skips_a_non_finite_gradient(tiny_qwen2_dir: Path) -> None:
    policy = _lora_policy(tiny_qwen2_dir)
    shared = SharedBase.build([policy], seed=0, cuda=False, device=CPU)
    engine = AdapterEngine(shared, policy)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))

    def step(nan: bool) -> None:
        with shared.active("agent"):
            logits = engine(input_ids=ids).logits
            if nan:
                logits = _NaNGradient.apply(logits)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            engine.backward(loss)
            assert engine.is_gradient_accumulation_boundary()
            engine.step()

    step(nan=False)
    before = _adapter_state(engine)
    step(nan=True)
    norm = engine.get_global_grad_norm()
    assert engine.skipped_steps == 1 and norm is not None and math.isnan(norm)
    assert not _changed(before, _adapter_state(engine))
    assert all(p.grad is None for p in engine.params)  # dropped: the next step starts clean
    step(nan=False)
    assert engine.skipped_steps == 1 and _changed(before, _adapter_state(engine))
    assert _finite(_adapter_state(engine))


def test_an_adapter_trainer_counts_the_skipped_step(
    gloo: None, direct_leases: _Leases, monkeypatch: pytest.MonkeyPatch, tiny_qwen2_dir: Path
) -> None:
    policy = _lora_policy(tiny_qwen2_dir, micro=2)  # two micro-batches accumulated
    shared = SharedBase.build([policy], seed=0, cuda=False, device=CPU)
    trainer = AdapterTrainer(
        "agent-trainer-0",
        policy.model_dump_json(by_alias=True),
        0,
        rank=0,
        world=1,
        buffer=direct_leases,  # type: ignore[arg-type]
        base=lambda device: shared,
    )
    trainer.setup(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    direct_leases.batches = [_batch(1), _batch(2)]
    engine = trainer.engine
    before = _adapter_state(engine)
    with shared.active("agent"), monkeypatch.context() as patch:
        _nan_gradient_in_backward(patch)
        skipped = trainer.train_step(1, N_SAMPLES, 2)
    assert skipped.skipped_nonfinite == 1 and math.isnan(skipped.grad_norm)
    assert not _changed(before, _adapter_state(engine)) and trainer.version == 1
    with shared.active("agent"):
        trained = trainer.train_step(2, N_SAMPLES, 2)
    assert trained.skipped_nonfinite == 0 and math.isfinite(trained.grad_norm)
    adapter = {f"adapter {n}": t for n, t in engine.adapter_state().items()}
    assert _changed({k: before[k] for k in adapter}, adapter)  # no optimizer state before its first step


# -- two ranks decide together -----------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2])
def test_two_ranks_skip_together_when_only_one_saw_it(tmp_path: Path, stage: int) -> None:
    """Rank 1's loss is NaN, its gradient finite: nothing DeepSpeed reduces carries it to rank 0, so
    only the guard's all-reduce makes rank 0 skip too (else it would step, rank 1 not: ZeRO-0
    replicas would part, ZeRO-2 would update half the partitions)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    env.pop("MASTER_PORT", None)
    env["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(port), str(stage), str(tmp_path / f"rank{r}.json")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-3000:]
    for r in range(2):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen == {"skipped": [1, 0], "unchanged": True, "moved": True, "version": 3}, (r, seen)
