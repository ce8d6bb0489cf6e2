"""Device sharing on CPU: one policy colocated on one core against dedicated cores, and two and four
policies on one pool of two cores against the same policies with dedicated roles on the same cores.

The same job (the built-in tiny policy playing both sides of the signalling game, sync mode) runs in
two layouts, each pinned with `polyrl run`'s CPU sets:

  colocated  rollout and trainer on one device pool (`pool: shared`), the pool and the workflow
             worker on one core: generation and training take turns on it;
  dedicated  the rollout engine and the workflow worker on one core, the trainer on another, as
             dedicated pods have them: in sync mode each core idles while the other role works.

For each it prints the trained samples per second, the cores the layout holds, trained samples per
core-second (what each layout gets from what it holds), and each pinned core's busy fraction over the
steady-state steps, read from /proc/stat (every process on that core counts, the unpinned driver
and experience buffer included: run it on an otherwise idle machine). The rounds alternate the two
layouts; the ratio colocated / dedicated is taken within each round and the table gives medians.
Goal (issue 28): samples per core-second colocated >= 1.8x dedicated, colocated core busy >= 0.9.

The second part runs N tiny policies on the guessing task (sync mode, one agent per policy each
episode) in two layouts on the same two cores:

  pooled     every rollout and trainer on one pool (`--cpus pool:shared=0-1`), whose cores the
             operating system shares among them (a CPU pool takes no turns:
             coordinator/pool_scheduler.py);
  dedicated  the rollouts and the workflow worker on one core, the trainers on the other.

It prints the wall time of the same steady-state steps in each layout (goal: pooled / dedicated
<= 1.0), and the pooled layout's switch time (engines asleep and awake, trainers restored and
offloaded) as a fraction of that wall time where the pool takes turns (a GPU pool; goal <= 0.05).

    .venv/bin/python benchmarks/sharing.py [--steps 24] [--episodes 32] [--rounds 3] [--policies 2,4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from _jobs import TINY_POLICY, run_job, split_cpus, start_ray, stop_ray, tiny_job

from polyrl_operator.api import RLJob
from polyrl_runtime.cpusets import POOL_PREFIX, format_cpus

GOAL_PER_CORE = 1.8
GOAL_BUSY = 0.9
GOAL_POOLED_WALL = 1.0
GOAL_SWITCH = 0.05
WARM_STEPS = 3  # the first steps include actor start-up and first compiles


def job(layout: str, steps: int, episodes: int) -> RLJob:
    policy: dict[str, Any] = {"name": "agent", **TINY_POLICY}
    spec: dict[str, Any] = {
        "mode": "sync",
        "training": {"totalSteps": steps, "episodesPerStep": episodes, "seed": 7},
        "workflow": {
            "entrypoint": "polyrl_runtime.workflows.signal:SignalGame",
            "args": {"vocab": 8, "symbols": 4, "policies": {"speaker": "agent", "listener": "agent"}},
        },
        "policies": [policy],
        "weightSync": {"transport": "objectstore"},
        "checkpoint": {"everySteps": 10_000},
    }
    if layout == "colocated":
        spec["pools"] = [{"name": "shared", "gpus": 0}]
        policy["rollout"] = {"engine": "torch", "pool": "shared"}
        policy["trainer"] = {"zeroStage": 1, "microBatchSize": 64, "pool": "shared"}
    return RLJob.model_validate(
        {
            "apiVersion": "polyrl.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": f"share-{layout}"},
            "spec": spec,
        }
    )


def layouts(cpus: list[int]) -> dict[str, dict[str, frozenset[int]]]:
    a, b = frozenset(cpus[:1]), frozenset(cpus[1:2])
    return {
        "colocated": {f"{POOL_PREFIX}shared": a, "workflow": a},
        "dedicated": {"rollout": a, "workflow": a, "trainer": b},
    }


def cpu_ticks() -> dict[int, tuple[int, int]]:
    """Per CPU: (busy ticks, all ticks) from /proc/stat."""
    out: dict[int, tuple[int, int]] = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                ticks = [int(x) for x in fields]
                idle = ticks[3] + ticks[4]  # idle + iowait
                out[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return out


@dataclass(frozen=True)
class Run:
    samples_per_s: float
    cores: int
    busy: dict[int, float]
    final_success: float

    @property
    def per_core_s(self) -> float:
        return self.samples_per_s / self.cores


def measure(layout: str, sets: dict[str, frozenset[int]], steps: int, episodes: int) -> Run | str:
    marks: list[tuple[float, dict[int, tuple[int, int]], int]] = []
    total = [0]

    def on_record(rec: Any) -> None:
        total[0] += rec.samples
        marks.append((time.monotonic(), cpu_ticks(), total[0]))

    summary = run_job(job(layout, steps, episodes), on_record, cpu_sets=sets)
    if summary.state != "done":
        return f"{summary.state}: {summary.message}"
    (t0, ticks0, s0), (t1, ticks1, s1) = marks[WARM_STEPS], marks[-1]
    held = sorted(set().union(*sets.values()))
    busy = {c: (ticks1[c][0] - ticks0[c][0]) / max(ticks1[c][1] - ticks0[c][1], 1) for c in held}
    succ = [r.success_mean for r in summary.records if r.success_mean is not None]
    return Run((s1 - s0) / (t1 - t0), len(held), busy, sum(succ[-3:]) / max(len(succ[-3:]), 1))


def many_job(layout: str, n: int, steps: int, episodes: int) -> RLJob:
    """N tiny policies on the guessing task, sync; `pooled`: every role of every policy on one pool."""
    names = [f"agent{i}" for i in range(n)]
    workflow = {"entrypoint": "polyrl_runtime.workflows.guessing:Guessing", "args": {"agents": names}}
    job = tiny_job(
        f"share{n}-{layout}",
        names,
        workflow,
        steps=steps,
        episodes=episodes,
        seed=7,
        mode="sync",
        staleness=0,
    )
    if layout == "dedicated":
        return job
    doc = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["spec"]["pools"] = [{"name": "shared", "gpus": 0}]
    for p in doc["spec"]["policies"]:
        p["rollout"] = {"engine": "torch", "pool": "shared"}
        p["trainer"] = {"zeroStage": 1, "microBatchSize": 64, "pool": "shared"}
    return RLJob.model_validate(doc)


@dataclass(frozen=True)
class ManyRun:
    wall_s: float  # the steady-state steps: from every policy's WARM_STEPS-th step to the last
    samples_per_s: float
    switch_s: float | None  # None: the pool took no turns (a CPU pool), or no pool


def measure_many(
    layout: str, n: int, sets: dict[str, frozenset[int]], steps: int, episodes: int
) -> ManyRun | str:
    recs: list[tuple[float, Any]] = []
    summary = run_job(
        many_job(layout, n, steps, episodes), lambda r: recs.append((time.monotonic(), r)), cpu_sets=sets
    )
    if summary.state != "done":
        return f"{summary.state}: {summary.message}"
    start = max(t for t, r in recs if r.step == WARM_STEPS)
    steady = [(t, r) for t, r in recs if t > start]
    wall = recs[-1][0] - start
    samples = sum(r.samples for _, r in steady)
    switches = [r.pool_switch_s for _, r in steady if r.pool_switch_s is not None]
    return ManyRun(wall, samples / wall, sum(switches) if switches else None)


def _switch(runs: list[ManyRun]) -> str:
    """The median switch time over the wall time, or n/a where the layout took no turns."""
    fractions = [r.switch_s / r.wall_s for r in runs if r.switch_s is not None]
    return f"{statistics.median(fractions):.3f}" if len(fractions) == len(runs) else "n/a"


def many_policies(counts: list[int], cpus: list[int], args: argparse.Namespace) -> None:
    sets = {
        "pooled": {f"{POOL_PREFIX}shared": frozenset(cpus[:2]), "workflow": frozenset(cpus[:2])},
        "dedicated": split_cpus(),
    }
    print("\n| policies | layout | cores (--cpus) | steady wall s | samples/s | switch s / wall |")
    print("|---|---|---|---|---|---|")
    verdicts = []
    for n in counts:
        runs: dict[str, list[ManyRun]] = {name: [] for name in sets}
        for _ in range(args.rounds):
            for name, layout_sets in sets.items():
                got = measure_many(name, n, layout_sets, args.steps, args.episodes)
                if isinstance(got, str):
                    raise SystemExit(f"{n} policies, {name}: {got}")
                runs[name].append(got)
        for name, rs in runs.items():
            where = " ".join(f"{key}={format_cpus(c)}" for key, c in sets[name].items())
            print(
                f"| {n} | {name} | {where} | {statistics.median(r.wall_s for r in rs):.1f} | "
                f"{statistics.median(r.samples_per_s for r in rs):.1f} | {_switch(rs)} |"
            )
        ratio = statistics.median(
            p.wall_s / d.wall_s for p, d in zip(runs["pooled"], runs["dedicated"], strict=True)
        )
        fractions = [r.switch_s / r.wall_s for r in runs["pooled"] if r.switch_s is not None]
        if len(fractions) < len(runs["pooled"]):
            switch = "none (a CPU pool takes no turns)"
        else:
            f = statistics.median(fractions)
            switch = (
                f"{f:.3f} of the wall (goal <= {GOAL_SWITCH}: {'met' if f <= GOAL_SWITCH else 'NOT met'})"
            )
        verdicts.append(
            f"{n} policies: pooled / dedicated wall {ratio:.2f}x (goal <= {GOAL_POOLED_WALL}: "
            f"{'met' if ratio <= GOAL_POOLED_WALL else 'NOT met'}), pooled switch time: {switch}"
        )
    print()
    print("\n".join(verdicts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default="2,4", help="policy counts of the second part ('' skips it)")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("the dedicated layout needs 2 CPUs", file=sys.stderr)
        return 1
    sets = layouts(cpus)
    start_ray()
    runs: dict[str, list[Run]] = {name: [] for name in sets}
    for k in range(args.rounds):
        for name, layout_sets in sets.items():
            got = measure(name, layout_sets, args.steps, args.episodes)
            if isinstance(got, str):
                print(f"{name}: {got}", file=sys.stderr)
                return 1
            runs[name].append(got)
            busy = " ".join(f"cpu{c}={b:.2f}" for c, b in got.busy.items())
            print(
                f"round {k + 1} {name:9} {got.samples_per_s:7.1f} samples/s on {got.cores} core(s): "
                f"{got.per_core_s:6.1f} per core-s, busy {busy}, final success {got.final_success:.2f}",
                flush=True,
            )
    counts = [int(c) for c in args.policies.split(",") if c]
    ratios = [c.per_core_s / d.per_core_s for c, d in zip(runs["colocated"], runs["dedicated"], strict=True)]
    print(
        f"\ncpus={len(cpus)} steps={args.steps} episodes/step={args.episodes} rounds={args.rounds} (medians)"
    )
    print("| layout | cores (--cpus) | samples/s | samples per core-s | busy per core | final success |")
    print("|---|---|---|---|---|---|")
    for name, rs in runs.items():
        where = " ".join(f"{key}={format_cpus(c)}" for key, c in sets[name].items())
        held = sorted(rs[0].busy)
        busy = ", ".join(f"cpu{c} {statistics.median(r.busy[c] for r in rs):.2f}" for c in held)
        print(
            f"| {name} | {where} | {statistics.median(r.samples_per_s for r in rs):.1f} | "
            f"{statistics.median(r.per_core_s for r in rs):.1f} | {busy} | "
            f"{statistics.median(r.final_success for r in rs):.2f} |"
        )
    ratio = statistics.median(ratios)
    coloc_busy = statistics.median(min(r.busy.values()) for r in runs["colocated"])
    print(
        f"\nsamples per core-second, colocated / dedicated: {ratio:.2f}x (rounds {min(ratios):.2f}-"
        f"{max(ratios):.2f}x; goal >= {GOAL_PER_CORE}x: {'met' if ratio >= GOAL_PER_CORE else 'NOT met'})"
    )
    print(
        f"colocated core busy: {coloc_busy:.2f} (goal >= {GOAL_BUSY}: "
        f"{'met' if coloc_busy >= GOAL_BUSY else 'NOT met'})"
    )
    if counts:
        many_policies(counts, cpus, args)
    stop_ray()
    return 0


if __name__ == "__main__":
    sys.exit(main())
