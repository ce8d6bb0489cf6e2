"""How reliably polyrl learns, against a plain GRPO loop: many seeds of each, in float32 and bfloat16.

Both sides train the guessing task (`Guessing`: 4 symbols, shift 1, sync, group 8, 64 episodes per
step, lr 3e-3, 40 steps) on a tiny Hugging Face Qwen2 that is not the built-in one: another width
(64) and other initial weights (seed 7), written to a local directory and loaded through
`from_pretrained` like any checkpoint. The plain loop is `grpo_reference.reference_run` (transformers
and torch AdamW in one process, group-normalised advantages, no clipping): GRPO as the paper and TRL
write it. polyrl is a one-policy sync RLJob (torch engine, DeepSpeed trainer on CPU, objectstore
weight sync) with the job's defaults.

A run's figure is its last-10 success (the mean success of its last 10 steps); a run counts as
learnt at >= 0.95. The goal: polyrl's fraction of learnt runs is at least the plain loop's, in both
dtypes.

    .venv/bin/python benchmarks/stability.py                                    # 10 seeds, both dtypes
    .venv/bin/python benchmarks/stability.py --seeds 2 --steps 4 --dtypes float32   # a smoke run

prints one line per run, then per dtype each side's fraction of learnt runs and whether the goal holds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).parent))
from grpo_reference import Task, polyrl_run, reference_run, tail

from polyrl_runtime.models.tiny_qwen2 import TinyQwen2Size, create_tiny_qwen2

LEARNT = 0.95
# Not the built-in tiny-qwen2 (hidden 96, seed 0): a user's own small model.
MODEL_SIZE = TinyQwen2Size(hidden_size=64, intermediate_size=192)
MODEL_SEED = 7

Runner = Callable[[Task, int, str, str], list[float]]
SIDES: dict[str, Runner] = {"plain": reference_run, "polyrl": polyrl_run}


def fraction_learnt(tails: Sequence[float]) -> float:
    return sum(t >= LEARNT for t in tails) / len(tails) if tails else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--sides", nargs="+", choices=sorted(SIDES), default=sorted(SIDES))
    args = ap.parse_args(argv)
    task = Task(symbols=4, shift=1, steps=args.steps, episodes=args.episodes, group=8, lr=3e-3)
    from _jobs import start_ray, stop_ray

    met = True
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"file://{create_tiny_qwen2(Path(tmp) / 'model', seed=MODEL_SEED, size=MODEL_SIZE)}"
        if "polyrl" in args.sides:
            start_ray()
        try:
            for dtype in args.dtypes:
                tails: dict[str, list[float]] = {side: [] for side in args.sides}
                for seed in range(args.first_seed, args.first_seed + args.seeds):
                    for side in args.sides:
                        t0 = time.perf_counter()
                        history = SIDES[side](task, seed, uri, dtype)
                        tails[side].append(tail(history))
                        print(
                            f"{dtype} seed {seed} {side}: last-10 success {tails[side][-1]:.3f}"
                            f" ({time.perf_counter() - t0:.0f} s)",
                            flush=True,
                        )
                line = f"{dtype}:"
                for side in args.sides:
                    line += (
                        f" {side} {fraction_learnt(tails[side]):.2f} of {len(tails[side])} runs >= {LEARNT}"
                        f" (mean {statistics.fmean(tails[side]):.3f});"
                    )
                if len(args.sides) == 2:
                    ok = fraction_learnt(tails["polyrl"]) >= fraction_learnt(tails["plain"])
                    met = met and ok
                    line += f" goal (polyrl >= plain) {'met' if ok else 'NOT met'}"
                print(line, flush=True)
        finally:
            if "polyrl" in args.sides:
                stop_ray()
    print("goal met in every dtype" if met else "goal NOT met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
