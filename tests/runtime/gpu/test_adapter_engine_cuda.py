"""Several policies' adapters on one base held once (trainers/adapter_engine.py) on CUDA: a step in
float32 on the GPU moves the adapter as the same step on the CPU does; over a bfloat16 base the
adapters and their optimizer state stay float32 and a step changes its own adapter only; the device
memory of one base with 4 adapters against 4 trainers of one adapter each (printed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.trainers.adapter_engine import AdapterEngine, SharedBase

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = torch.device("cuda")


def _policies(model_dir: Path, dtype: str, n: int) -> list[Policy]:
    lora = {"rank": 8, "alpha": 16, "targetModules": ["all-linear"]}
    return [
        Policy.model_validate(
            {
                "name": f"p{i}",
                "model": {"uri": f"file://{model_dir}", "dtype": dtype},
                "algorithm": {"lr": 1e-2, "lora": lora},
            }
        )
        for i in range(n)
    ]


def _stepped(model_dir: Path, dtype: str, device: torch.device, n: int = 2) -> SharedBase:
    """A shared base of `n` adapters (the same initial draw on every device) after one step of p0."""
    torch.manual_seed(0)
    policies = _policies(model_dir, dtype, n)
    shared = SharedBase.build(policies, seed=0, cuda=device.type == "cuda", device=device)
    engine = AdapterEngine(shared, policies[0])
    ids = torch.randint(3, 300, (4, 24), generator=torch.Generator().manual_seed(1)).to(device)
    with shared.active("p0"):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return shared


def test_a_float32_step_on_the_gpu_moves_the_adapter_as_on_the_cpu(varied_qwen2: Path) -> None:
    cpu = dict(_stepped(varied_qwen2, "float32", torch.device("cpu")).adapter_parameters("p0"))
    gpu = dict(_stepped(varied_qwen2, "float32", GPU).adapter_parameters("p0"))
    assert cpu.keys() == gpu.keys()
    worst = max(float((cpu[n].detach() - gpu[n].detach().cpu()).abs().max()) for n in cpu)
    sys.stdout.write(f"\nadapter after one step, CUDA vs CPU float32: max |diff| {worst:.2e}\n")
    assert worst < 1e-4


def test_over_a_bfloat16_base_adapters_train_in_float32_and_alone(varied_qwen2: Path) -> None:
    torch.manual_seed(0)
    before = {
        n: p.detach().clone()
        for n, p in SharedBase.build(
            _policies(varied_qwen2, "bfloat16", 2), seed=0, cuda=True, device=GPU
        ).model.named_parameters()
    }
    shared = _stepped(varied_qwen2, "bfloat16", GPU)
    after = dict(shared.model.named_parameters())
    assert {p.dtype for _, p in shared.adapter_parameters("p0")} == {torch.float32}
    assert {p.dtype for n, p in after.items() if ".lora_" not in n} == {torch.bfloat16}
    changed = {n for n, p in after.items() if not torch.equal(before[n], p.detach())}
    assert changed and all(".p0." in n for n in changed)


def test_device_memory_of_four_adapters_on_one_base_against_four_trainers(varied_qwen2: Path) -> None:
    peaks = {}
    for n in (1, 4):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        shared = _stepped(varied_qwen2, "bfloat16", GPU, n)
        peaks[n] = torch.cuda.max_memory_allocated() - start
        del shared
    ratio = peaks[4] / (4 * peaks[1])
    sys.stdout.write(
        f"\ntrainer device memory: one base with 4 adapters {peaks[4] / 2**20:.1f} MiB peak, "
        f"4 trainers of one adapter {4 * peaks[1] / 2**20:.1f} MiB: {ratio:.2f}x\n"
    )
    assert ratio < 1.0
