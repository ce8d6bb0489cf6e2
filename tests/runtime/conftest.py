"""Shared fixtures for the runtime tests: one local Ray session for every test that needs Ray."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

# Before ray is initialised anywhere (the Makefile exports the same; plain `pytest` must work too).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    import ray

    if not ray.is_initialized():
        ray.init(
            # Always a fresh local cluster: without it ray.init() may join one that another process on
            # this host started (it is recorded in /tmp/ray/ray_current_cluster).
            address="local",
            num_cpus=2,
            include_dashboard=False,
            logging_level="WARNING",
            object_store_memory=2 << 30,
            # Workers must not oversubscribe the two cores either.
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Hugging Face model directory (tiny Qwen2 + BPE tokenizer with a chat template), built in code
    and saved like any checkpoint: load it with `file://` + this path."""
    from polyrl_runtime.models.tiny_qwen2 import create_tiny_qwen2

    return create_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny-qwen2")
