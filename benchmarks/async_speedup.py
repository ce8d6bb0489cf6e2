"""Async vs sync training throughput on this machine's CPU, with long-tail generation lengths.

The same two-policy job (speaker/listener signalling game; the listener's replies have a Pareto
length tail, so a few episodes take far longer than the rest) runs in `sync` mode and in `async` mode
with maxStaleness 1 and 2. Prints steady-state optimizer steps per second of each, the ratio
async/sync, and each run's final success rate, so speed is not bought with learning.

    .venv/bin/python benchmarks/async_speedup.py [--steps 30] [--tail 96]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray

from polyrl_operator.api import RLJob
from polyrl_runtime.config import set_env_defaults
from polyrl_runtime.coordinator.driver import Driver, DriverOptions, RunSummary


def job(mode: str, staleness: int, steps: int, tail: int, episodes: int, *, alpha: float = 0.8) -> RLJob:
    policy = {
        "model": {"uri": "builtin://tiny"},
        "algorithm": {"name": "grpo", "groupSize": 4, "lr": 3e-3},
        "rollout": {"engine": "torch", "gpus": 0},
        "trainer": {"zeroStage": 1, "gpus": 0, "microBatchSize": 64},
    }
    return RLJob.model_validate(
        {
            "apiVersion": "polyrl.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": f"bench-{mode}-{staleness}"},
            "spec": {
                "mode": mode,
                "maxStaleness": staleness,
                "training": {"totalSteps": steps, "episodesPerStep": episodes, "seed": 7},
                "workflow": {
                    "entrypoint": "polyrl_runtime.workflows.signal:SignalGame",
                    "args": {"vocab": 8, "symbols": 4, "tail_tokens": tail, "tail_alpha": alpha},
                },
                "policies": [{"name": n, **policy} for n in ("speaker", "listener")],
                "weightSync": {"transport": "objectstore"},
                "checkpoint": {"everySteps": 10_000},
            },
        }
    )


def run(j: RLJob) -> tuple[RunSummary, list[float]]:
    stamps: list[float] = []

    def on_record(rec: Any) -> None:
        if rec.policy == "listener":
            stamps.append(time.monotonic())

    with tempfile.TemporaryDirectory() as tmp:
        opts = DriverOptions(
            out_dir=Path(tmp),
            checkpoint_root=Path(tmp) / "ckpt",
            place_by_resource=False,
            on_record=on_record,
        )
        summary = asyncio.run(Driver(j, opts).run())
    return summary, stamps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--tail", type=int, default=96, help="longest extra reply (tokens) in the Pareto tail")
    ap.add_argument(
        "--alpha", type=float, default=0.8, help="Pareto shape of the reply lengths (smaller: longer tail)"
    )
    args = ap.parse_args()
    set_env_defaults()
    ray.init(
        address="local",
        num_cpus=os.cpu_count() or 2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    rows = []
    for mode, s in (("sync", 0), ("async", 1), ("async", 2)):
        summary, stamps = run(job(mode, s, args.steps, args.tail, args.episodes, alpha=args.alpha))
        if summary.state != "done":
            print(f"{mode}/{s}: {summary.state}: {summary.message}", file=sys.stderr)
            return 1
        warm = 3  # skip the first steps (actor start, first compiles)
        rate = (len(stamps) - 1 - warm) / (stamps[-1] - stamps[warm])
        succ = [
            r.success_mean for r in summary.records if r.policy == "listener" and r.success_mean is not None
        ]
        final = sum(succ[-5:]) / len(succ[-5:])
        stale = max(r.staleness_max for r in summary.records)
        rows.append((f"{mode} (maxStaleness {s})", rate, final, stale))
        print(
            f"{rows[-1][0]:26s} {rate:6.2f} steps/s  final success {final:.2f}  max staleness {stale}",
            flush=True,
        )
    base = rows[0][1]
    print(
        f"\ncpus={os.cpu_count()} steps={args.steps} episodes/step={args.episodes} "
        f"reply tail: Pareto(alpha={args.alpha}) up to {args.tail} tokens"
    )
    print("| mode | steps/s | vs sync | final success (last 5 steps) | max staleness |")
    print("|---|---|---|---|---|")
    for name, rate, final, stale in rows:
        print(f"| {name} | {rate:.2f} | {rate / base:.2f}x | {final:.2f} | {stale} |")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
