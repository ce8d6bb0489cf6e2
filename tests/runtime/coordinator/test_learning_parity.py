"""polyrl learns the guessing task with a Hugging Face policy at least as well as a plain GRPO loop.

The plain loop is `benchmarks/grpo_reference.py` (transformers + torch AdamW, group-normalised
advantages): the yardstick. Both start from the same tiny Qwen2 weights and see the same task, batch,
group size and learning rate. Seeded sync jobs reproduce their metrics (test_reproducible.py) and the
reference loop is seeded too, so on a given machine the outcome is fixed, not a draw: the tolerance
covers the difference between the two programs' random streams, not run-to-run noise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from driver_harness import run

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from grpo_reference import Task, polyrl_job, reference_run, tail

TOLERANCE = 0.1


@pytest.mark.slow
def test_polyrl_learns_as_well_as_the_reference(ray_local: Any, tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    task = Task(symbols=4, shift=1, steps=30, episodes=64, group=8, lr=3e-3)
    uri = f"file://{tiny_qwen2_dir}"
    reference = tail(reference_run(task, seed=1, model_uri=uri))
    driver, summary = run(polyrl_job(task, seed=1, model_uri=uri), tmp_path)
    assert summary.state == "done", summary.message
    history = [r.success_mean for r in driver.records]
    assert all(s is not None for s in history)
    polyrl = tail([float(s) for s in history if s is not None])
    chance = 1 / task.symbols
    assert polyrl >= reference - TOLERANCE, (polyrl, reference, history)
    assert polyrl >= chance + 0.4, (polyrl, chance, history)  # learnt, not a lucky tail
