"""Fixtures of the trainer tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from polyrl_operator.api import Policy
from polyrl_runtime.netmap import free_port


@pytest.fixture(scope="module")
def gloo() -> Iterator[None]:
    """A world-1 gloo process group in this process (DeepSpeed needs one to build an engine)."""
    import torch.distributed as dist

    from polyrl_runtime.trainers.deepspeed_import import import_deepspeed

    if not dist.is_initialized():
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
        import_deepspeed().init_distributed(dist_backend="gloo")
    yield


@pytest.fixture(scope="module")
def hf_policy() -> Callable[[Path, int], Policy]:
    """A policy that trains the model directory with ZeRO stage `stage` on CPU."""

    def make(model_dir: Path, stage: int) -> Policy:
        return Policy.model_validate(
            {
                "name": "agent",
                "model": {"uri": f"file://{model_dir}", "dtype": "float32"},
                "algorithm": {"lr": 1e-2},
                "rollout": {"engine": "torch", "gpus": 0},
                "trainer": {"gpus": 0, "zeroStage": stage, "microBatchSize": 4},
            }
        )

    return make
