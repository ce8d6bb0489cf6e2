"""How reliably a CPU example learns: the same job run N times, each run's final success.

The signalling game (the default example) has a local optimum (two symbols on one letter, success
~0.75) that a run can settle in; async training is not deterministic, so runs of the same job differ.
A sync job with a seed repeats itself exactly, so `--seed-per-run` gives run i `training.seed` i.
Each run's figure is the mean success of its last 10 steps (one 64-episode step alone is noisy), per
policy, and the first step whose success reached the goal. Overrides change the example before it runs:

    .venv/bin/python benchmarks/example_robustness.py [--runs 10] [--set PATH=VALUE ...]
    .venv/bin/python benchmarks/example_robustness.py --set workflow.args.vocab=8
    .venv/bin/python benchmarks/example_robustness.py --set policies.*.algorithm.klCoef=0.03
    .venv/bin/python benchmarks/example_robustness.py --example guessing-hf-cpu --goal 0.7 --runs 5 --seed-per-run

PATH is dotted under `spec`; `*` means every item of a list. VALUE is read as YAML.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from _jobs import run_job, start_ray, stop_ray

from polyrl_operator.api import RLJob

EXAMPLES = Path(__file__).resolve().parents[1] / "manifests" / "examples"
LAST = 10  # steps averaged for a run's final success


def apply_override(spec: dict[str, Any], assignment: str) -> None:
    path, sep, text = assignment.partition("=")
    if not sep or not path:
        raise SystemExit(f"--set {assignment!r}: expected PATH=VALUE")
    *parents, leaf = path.split(".")
    nodes: list[Any] = [spec]
    for key in parents:
        if key == "*":
            nodes = [item for node in nodes for item in node]
        else:
            nodes = [node.setdefault(key, {}) for node in nodes]
    for node in nodes:
        node[leaf] = yaml.safe_load(text)


def final_success(records: list[Any], policy: str, goal: float) -> tuple[float, int | None]:
    mine = [r.success_mean for r in records if r.policy == policy and r.success_mean is not None]
    tail = mine[-LAST:]
    first = next((step for step, success in enumerate(mine, start=1) if success >= goal), None)
    return (sum(tail) / len(tail) if tail else 0.0), first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    ap.add_argument("--example", default="signal-game-cpu", help="a file of manifests/examples, no .yaml")
    ap.add_argument("--goal", type=float, default=0.9, help="the last-10 success a run must reach")
    ap.add_argument("--seed-per-run", action="store_true", help="run i trains with training.seed i")
    ap.add_argument("--first-seed", type=int, default=1, help="with --seed-per-run: the seed of run 1")
    args = ap.parse_args()
    doc = yaml.safe_load((EXAMPLES / f"{args.example}.yaml").read_text())
    for assignment in args.overrides:
        apply_override(doc["spec"], assignment)
    job = RLJob.model_validate(doc)
    policies = [p.name for p in job.spec.policies]
    goal = args.goal
    start_ray()
    print("| run | " + " | ".join(f"{p}: last {LAST} steps / first step >= {goal}" for p in policies) + " |")
    print("|---|" + "---|" * len(policies))
    good = 0
    for run in range(1, args.runs + 1):
        if args.seed_per_run:
            job = job.model_copy(
                update={
                    "spec": job.spec.model_copy(
                        update={
                            "training": job.spec.training.model_copy(
                                update={"seed": run + args.first_seed - 1}
                            )
                        }
                    )
                }
            )
        summary = run_job(job)
        if summary.state != "done":
            raise SystemExit(f"run {run} failed: {summary.message}")
        finals = [final_success(summary.records, p, goal) for p in policies]
        good += all(mean >= goal for mean, _ in finals)
        cells = " | ".join(f"{mean:.2f} / {first if first else '-'}" for mean, first in finals)
        print(f"| {run} | {cells} |", flush=True)
    print(f"\n{good} of {args.runs} runs at >= {goal} for every policy")
    print(f"example={args.example} cpus={os.cpu_count()} overrides={args.overrides or 'none'}")
    stop_ray()
    return 0


if __name__ == "__main__":
    sys.exit(main())
