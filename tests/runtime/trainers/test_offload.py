"""A trainer rank's offload to host memory and restore, on CPU with gloo (world 1, in this process).

On the CPU the host is the device: `offload` copies every storage of the rank's state into a host
buffer and releases the original, the code path a GPU rank runs (the CUDA run, with the device
memory freed measured, is tests/runtime/gpu/test_offload_cuda.py). A round trip changes no bit of any
storage (parameters, ZeRO shards and flat groups, optimizer state, step counters), and one more
training step after it gives bit for bit what the same step gives without it, for ZeRO stages 0, 2
and 3.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.device_memory import HostBuffers, park, unique_storages
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer
from polyrl_runtime.trainers.offload import TrainerOffloadedError, object_tensors, rank_storages
from polyrl_testenv.trainer_rank import in_process_rank

CPU = torch.device("cpu")


def _train(rank: DeepSpeedTrainer, offset: int) -> None:
    """One DeepSpeed step on a fixed batch (`offset` tells steps apart)."""
    engine = rank.engine
    ids = (torch.arange(offset, offset + 16).reshape(2, 8) * 7) % 300
    logits = engine(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    engine.backward(loss)
    engine.step()


def _torch_optimizer(rank: DeepSpeedTrainer) -> torch.optim.Optimizer:
    opt: Any = rank.engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


def _state(rank: DeepSpeedTrainer) -> dict[str, torch.Tensor]:
    """The rank's trained state by name: its parameters (ZeRO-3: this rank's shards) and the
    optimizer's state of each parameter it steps (exp_avg, exp_avg_sq, step)."""
    out = {}
    for name, p in rank.engine.module.named_parameters():
        shard: Any = getattr(p, "ds_tensor", None)
        out[f"param {name}"] = (shard if shard is not None else p.data).detach().clone()
    opt = _torch_optimizer(rank)
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        for key, value in opt.state[p].items():
            out[f"optimizer {i} {key}"] = (
                value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
            )
    return out


def _assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    # torch.equal on the raw bytes: NaN == NaN and -0.0 != 0.0, bit for bit
    differ = [k for k in a if not torch.equal(_raw(a[k]), _raw(b[k]))]
    assert not differ, differ


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _storage_bytes(rank: DeepSpeedTrainer) -> list[torch.Tensor]:
    return [
        torch.empty(0, dtype=torch.uint8).set_(s).clone() for s in rank_storages(rank.engine, rank.ref, CPU)
    ]


@pytest.mark.parametrize(
    ("stage", "kl_coef"),
    [(0, 0.0), (2, 0.0), (3, 0.0), pytest.param(3, 0.1, id="3-with-kl-reference")],
)
def test_an_offload_round_trip_changes_no_bit_and_the_next_step_is_the_same(
    gloo: None, hf_policy: Callable[[Path, int], Policy], tiny_qwen2_dir: Path, stage: int, kl_coef: float
) -> None:
    policy = hf_policy(tiny_qwen2_dir, stage)
    policy = policy.model_copy(update={"algorithm": policy.algorithm.model_copy(update={"kl_coef": kl_coef})})
    pooled, dedicated = in_process_rank(policy), in_process_rank(policy)
    assert (pooled.ref is not None) == (kl_coef > 0)
    for rank in (pooled, dedicated):
        _train(rank, 0)
    _assert_bit_equal(_state(pooled), _state(dedicated))
    before, every_byte = _state(pooled), _storage_bytes(pooled)
    held = sum(b.numel() for b in every_byte)

    report = pooled.offload()
    assert report.direction == "offload" and report.rank == 0 and report.seconds > 0
    # every storage of the rank's state went to its host copy (none was left behind) ...
    assert report.moved_bytes == held and not rank_storages(pooled.engine, pooled.ref, CPU)
    opt_state = [t for t in object_tensors(_torch_optimizer(pooled).state) if t.numel()]
    assert opt_state and all(t.untyped_storage().nbytes() == 0 for t in opt_state)
    # ... and the parameters the model computes with are among them
    modules = [pooled.engine.module, *([getattr(pooled.ref, "module", pooled.ref)] if pooled.ref else [])]
    params = [getattr(p, "ds_tensor", p.data) for m in modules for p in m.parameters()]
    assert all(p.untyped_storage().nbytes() == 0 for p in params)  # the reference's too

    back = pooled.restore()
    assert (back.direction, back.moved_bytes) == ("restore", held)
    after = _storage_bytes(pooled)
    assert len(after) == len(every_byte) and all(
        torch.equal(x, y) for x, y in zip(after, every_byte, strict=True)
    )
    _assert_bit_equal(_state(pooled), before)

    for rank in (pooled, dedicated):
        _train(rank, 5)
    assert pooled.engine.global_steps == dedicated.engine.global_steps == 2
    _assert_bit_equal(_state(pooled), _state(dedicated))
    assert not all(torch.equal(before[k], v) for k, v in _state(pooled).items())  # the step moved


def test_an_offloaded_rank_refuses_what_needs_its_tensors(
    gloo: None, hf_policy: Callable[[Path, int], Policy], tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    rank = in_process_rank(hf_policy(tiny_qwen2_dir, 0))
    with pytest.raises(RuntimeError, match="not offloaded"):
        rank.restore()
    rank.offload()
    with pytest.raises(RuntimeError, match="offloaded already"):
        rank.offload()
    calls: dict[str, Callable[[], object]] = {
        "training step 1": lambda: rank.train_step(1, 0, 1),
        "publishing weights": rank.weight_tensors,
        "saving a checkpoint": lambda: rank.save(str(tmp_path), "t"),
        "exporting": lambda: rank.export(str(tmp_path / "hf")),
    }
    for what, call in calls.items():
        with pytest.raises(TrainerOffloadedError, match=f"agent-trainer-0: .*restore\\(\\) it before {what}"):
            call()
    rank.restore()
    assert rank.train_step(1, 0, 1).samples == 0  # resident again: an (empty) step runs


def test_parking_drops_storages_not_owned_by_torch_and_restores_views_of_one_buffer() -> None:
    import numpy as np

    flat = torch.arange(12, dtype=torch.float32)
    views = [flat[:4], flat[4:].view(2, 4)]
    foreign = torch.from_numpy(np.ones(3, dtype=np.float32))  # numpy's memory: cannot be released
    storages = unique_storages([*views, flat, foreign])
    assert len(storages) == 2
    parked = park(keep=storages)
    assert (parked.nbytes, parked.kept_bytes, parked.host_bytes) == (48, 12, 48)
    assert flat.untyped_storage().nbytes() == 0
    parked.restore("test")
    assert torch.equal(views[1], torch.arange(4, 12, dtype=torch.float32).view(2, 4))
    views[0][0] = 100.0  # still one buffer: a write through one view shows in the others
    assert flat[0] == 100.0
    with pytest.raises(RuntimeError, match="restored already"):
        parked.restore("test")
    dropped = park(drop=unique_storages([flat]))
    assert (dropped.nbytes, dropped.host_bytes) == (48, 0)
    dropped.restore("test")
    assert flat.untyped_storage().nbytes() == 48  # room again; its bytes are for the owner to write


def test_an_owner_that_parks_again_reuses_its_host_buffers() -> None:
    """The host copies go back to the owner's `HostBuffers` on restore and carry the next park: after
    the first, no park allocates, and every round trip still changes no bit."""
    a, b = torch.arange(1000, dtype=torch.float32), torch.arange(7, dtype=torch.int64)
    expected = [a.clone(), b.clone()]
    buffers = HostBuffers()
    for turn in range(3):
        parked = park(keep=unique_storages([a, b]), buffers=buffers)
        assert buffers.allocated == 2 and buffers.held_bytes == 0  # in use while parked
        parked.restore("test")
        assert buffers.held_bytes == 4000 + 56  # back for the next park
        assert torch.equal(a, expected[0]) and torch.equal(b, expected[1]), turn
        a += 1  # the owner trains between turns: the next park copies the new bytes
        expected[0] += 1
