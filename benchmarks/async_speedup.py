"""Async vs sync training throughput on this machine's CPU, with long-tail generation lengths.

The same two-policy job (speaker/listener signalling game; the listener's replies have a Pareto
length tail, so a few episodes take far longer than the rest) runs in `sync` mode and in `async` mode
with maxStaleness 1 and 2. Prints steady-state optimizer steps per second of each, the ratio
async/sync, and each run's final success rate, so speed is not bought with learning.

    .venv/bin/python benchmarks/async_speedup.py [--steps 30] [--tail 96]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from _jobs import run_job, start_ray, stop_ray, tiny_job

from polyrl_operator.api import RLJob
from polyrl_runtime.coordinator.report import RunSummary


def job(mode: str, staleness: int, steps: int, tail: int, episodes: int, *, alpha: float = 0.8) -> RLJob:
    workflow = {
        "entrypoint": "polyrl_runtime.workflows.signal:SignalGame",
        "args": {"vocab": 8, "symbols": 4, "tail_tokens": tail, "tail_alpha": alpha},
    }
    return tiny_job(
        f"bench-{mode}-{staleness}",
        ["speaker", "listener"],
        workflow,
        steps=steps,
        episodes=episodes,
        seed=7,
        mode=mode,
        staleness=staleness,
    )


def run(j: RLJob) -> tuple[RunSummary, list[float]]:
    stamps: list[float] = []

    def on_record(rec: Any) -> None:
        if rec.policy == "listener":
            stamps.append(time.monotonic())

    return run_job(j, on_record), stamps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--tail", type=int, default=96, help="longest extra reply (tokens) in the Pareto tail")
    ap.add_argument(
        "--alpha", type=float, default=0.8, help="Pareto shape of the reply lengths (smaller: longer tail)"
    )
    args = ap.parse_args()
    start_ray()
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
    stop_ray()
    return 0


if __name__ == "__main__":
    sys.exit(main())
