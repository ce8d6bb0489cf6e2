"""Several policies in one job vs the same policies trained one after another (wall time).

For N in 1, 2, 4: one job with N policies (each plays its own guessing task inside a shared episode)
against N single-policy jobs run back to back, each with the same steps and episodes per step.
Prints both wall times (start-up included: that is what a user waits for) and the ratio.

    .venv/bin/python benchmarks/policy_scaling.py [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _jobs import run_job, start_ray, stop_ray, tiny_job

from polyrl_operator.api import RLJob


def job(names: list[str], steps: int, episodes: int) -> RLJob:
    workflow = {"entrypoint": "polyrl_runtime.workflows.guessing:Guessing", "args": {"agents": names}}
    return tiny_job("scaling", names, workflow, steps=steps, episodes=episodes, seed=3)


def wall(j: RLJob) -> tuple[float, float]:
    start = time.monotonic()
    summary = run_job(j)
    took = time.monotonic() - start
    if summary.state != "done":
        raise SystemExit(f"run failed: {summary.message}")
    last = [r.success_mean or 0.0 for r in summary.records[-len(j.spec.policies) :]]
    return took, sum(last) / len(last)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--max-policies", type=int, default=4)
    args = ap.parse_args()
    start_ray()
    print("| policies | one job (s) | one after another (s) | ratio | success (joint) |")
    print("|---|---|---|---|---|")
    n = 1
    while n <= args.max_policies:
        names = [f"p{i}" for i in range(n)]
        joint, success = wall(job(names, args.steps, args.episodes))
        sequential = sum(wall(job([name], args.steps, args.episodes))[0] for name in names)
        print(
            f"| {n} | {joint:.1f} | {sequential:.1f} | {sequential / joint:.2f}x | {success:.2f} |",
            flush=True,
        )
        n *= 2
    print(f"\ncpus={os.cpu_count()} steps={args.steps} episodes/step={args.episodes}")
    stop_ray()
    return 0


if __name__ == "__main__":
    sys.exit(main())
