"""One of two DeepSpeed trainer ranks (CPU, gloo) for test_nonfinite.py, run as a process of its own:
`python nonfinite_ranks.py RANK PORT STAGE OUT`. It takes a normal step, then a step in which only
rank 1's loss is NaN (its gradient finite, so nothing reduced carries it to rank 0), then a normal
step, and writes what it saw to OUT (JSON)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from polyrl_operator.api import Policy
from polyrl_runtime.trainers import deepspeed_trainer
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer

sys.path.insert(0, str(Path(__file__).parent))
from test_nonfinite import N_SAMPLES, _batch, _Leases, _state


def _params(rank: DeepSpeedTrainer) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _state(rank.engine).items() if k.startswith(("param ", "master "))}


def main(rank_id: int, port: int, stage: int, out: Path) -> None:
    deepspeed_trainer.ray = SimpleNamespace(get=lambda ref: ref)  # type: ignore[assignment]
    policy = Policy.model_validate(
        {
            "name": "agent",
            "model": {"uri": "builtin://tiny", "dtype": "float32"},
            "algorithm": {"lr": 1e-2},
            "rollout": {"engine": "torch", "gpus": 0},
            "trainer": {"gpus": 0, "zeroStage": stage, "microBatchSize": N_SAMPLES},
        }
    )
    leases = _Leases()
    leases.batches = [_batch(10 * rank_id + k) for k in range(3)]
    rank = DeepSpeedTrainer(
        f"agent-trainer-{rank_id}",
        policy.model_dump_json(by_alias=True),
        0,
        rank=rank_id,
        world=2,
        buffer=leases,  # type: ignore[arg-type]
        total_steps=4,
    )
    rank.setup("127.0.0.1", port, local_rank=rank_id)
    rank.train_step(1, N_SAMPLES, 1)
    before = _params(rank)
    real = rank._forward_loss

    def nan_loss(*args: Any) -> tuple[torch.Tensor, Any]:
        loss, stats = real(*args)
        return loss + math.nan, stats  # a NaN value; the gradient is the finite one

    if rank_id == 1:
        rank._forward_loss = nan_loss  # type: ignore[method-assign]
    skipped = rank.train_step(2, N_SAMPLES, 1)
    rank._forward_loss = real  # type: ignore[method-assign]
    after = _params(rank)
    trained = rank.train_step(3, N_SAMPLES, 1)
    moved = _params(rank)
    out.write_text(
        json.dumps(
            {
                "skipped": [skipped.skipped_nonfinite, trained.skipped_nonfinite],
                "unchanged": all(torch.equal(before[k], after[k]) for k in before),
                "moved": any(not torch.equal(after[k], moved[k]) for k in after),
                "version": rank.version,
            }
        )
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
