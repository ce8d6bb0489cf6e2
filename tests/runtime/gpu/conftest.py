"""Fixtures of the device and dtype parity tests (their CUDA rows are the `gpu` tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyrl_testenv.models import lively_qwen2


@pytest.fixture(scope="session")
def varied_qwen2(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin://tiny-qwen2's directory with its matrices re-drawn at std 0.15 (float32 on disk).

    Freshly initialised (std 0.02) its next-token distributions are nearly uniform: every
    log-probability is about -log(vocab), and a mismatch between two computations would hide in them."""
    return lively_qwen2(tiny_qwen2_dir, tmp_path_factory.mktemp("gpu-tier") / "tiny-qwen2-varied", seed=1)
