"""Several policies in one job vs the same policies trained one after another (wall time).

For N in 1, 2, 4: one job with N policies (each plays its own guessing task inside a shared episode)
against N single-policy jobs run back to back, each with the same steps and episodes per step.
Prints both wall times (start-up included: that is what a user waits for) and the ratio.

    .venv/bin/python benchmarks/policy_scaling.py [--steps 12]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray

from polyrl_operator.api import RLJob
from polyrl_runtime.config import set_env_defaults
from polyrl_runtime.coordinator.driver import Driver, DriverOptions


def job(names: list[str], steps: int, episodes: int) -> RLJob:
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
            "metadata": {"name": "scaling"},
            "spec": {
                "mode": "async",
                "maxStaleness": 1,
                "training": {"totalSteps": steps, "episodesPerStep": episodes, "seed": 3},
                "workflow": {
                    "entrypoint": "polyrl_runtime.workflows.guessing:Guessing",
                    "args": {"agents": names},
                },
                "policies": [{"name": n, **policy} for n in names],
                "weightSync": {"transport": "objectstore"},
                "checkpoint": {"everySteps": 10_000},
            },
        }
    )


def wall(j: RLJob) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        opts = DriverOptions(out_dir=Path(tmp), checkpoint_root=Path(tmp) / "c", place_by_resource=False)
        start = time.monotonic()
        summary = asyncio.run(Driver(j, opts).run())
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
    set_env_defaults()
    ray.init(
        address="local",
        num_cpus=os.cpu_count() or 2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
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
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
