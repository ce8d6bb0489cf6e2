"""Async vs sync training throughput on this machine's CPU, with long-tail generation lengths.

The same two-policy job (speaker/listener signalling game; the listener's replies have a Pareto
length tail, so a few episodes take far longer than the rest) runs in `sync` mode and in `async` mode
with maxStaleness 1 and 2. Prints steady-state optimizer steps per second of each, the ratio
async/sync, and each run's final success rate, so speed is not bought with learning. The three runs
are repeated for `--rounds` rounds and each ratio is taken within its round (the machine's load moves
between rounds); the tables give medians.

Two placements, each with its own table:
  shared  every actor may run on every core, each in a process of its own (`polyrl run --separate`);
  split   rollout engines and workflow workers on half the cores, trainers on the other half
          (`polyrl run --cpus`), as the operator's pods have them: a role's devices are its own, so
          sync mode leaves the trainers' cores idle while the rollouts generate, and the other way
          round. This is the setting async mode is for (AReaL's 2.57x is measured on split devices).

    .venv/bin/python benchmarks/async_speedup.py [--steps 30] [--tail 96] [--rounds 3] [--placement both]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from _jobs import run_job, split_cpus, start_ray, stop_ray, tiny_job

from polyrl_operator.api import RLJob
from polyrl_runtime.coordinator.report import RunSummary
from polyrl_runtime.cpusets import format_cpus


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


PLACEMENTS = ("shared", "split")


def run(j: RLJob, cpu_sets: dict[str, frozenset[int]] | None) -> tuple[RunSummary, list[float]]:
    stamps: list[float] = []

    def on_record(rec: Any) -> None:
        if rec.policy == "listener":
            stamps.append(time.monotonic())

    return run_job(j, on_record, cpu_sets=cpu_sets), stamps


def measure(j: RLJob, cpu_sets: dict[str, frozenset[int]] | None) -> tuple[float, float, int] | str:
    """Steady-state steps/s, the listener's final success (last 5 steps) and the max staleness of
    one run, or why it failed."""
    summary, stamps = run(j, cpu_sets)
    if summary.state != "done":
        return f"{summary.state}: {summary.message}"
    warm = 3  # skip the first steps (actor start, first compiles)
    rate = (len(stamps) - 1 - warm) / (stamps[-1] - stamps[warm])
    succ = [r.success_mean for r in summary.records if r.policy == "listener" and r.success_mean is not None]
    return rate, sum(succ[-5:]) / len(succ[-5:]), max(r.staleness_max for r in summary.records)


Mode = tuple[str, int]
MODES: tuple[Mode, ...] = (("sync", 0), ("async", 1), ("async", 2))


def table(runs: dict[Mode, list[tuple[float, float, int]]]) -> None:
    print(
        "| mode | steps/s (median) | vs sync (median of rounds) | range over rounds | final success | max staleness |"
    )
    print("|---|---|---|---|---|---|")
    sync_rates = [r[0] for r in runs[MODES[0]]]
    for (mode, s), rs in runs.items():
        ratios = [r[0] / b for r, b in zip(rs, sync_rates, strict=True)]
        finals = " / ".join(f"{r[1]:.2f}" for r in rs)
        print(
            f"| {mode} (maxStaleness {s}) | {statistics.median(r[0] for r in rs):.2f} | "
            f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x | {finals} | "
            f"{max(r[2] for r in rs)} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--tail", type=int, default=96, help="longest extra reply (tokens) in the Pareto tail")
    ap.add_argument(
        "--alpha", type=float, default=0.8, help="Pareto shape of the reply lengths (smaller: longer tail)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of (sync, async 1, async 2) back to back per placement; ratios are taken within a "
        "round, so a load change between rounds does not land on one mode only",
    )
    ap.add_argument(
        "--placement",
        choices=[*PLACEMENTS, "both"],
        default="both",
        help="shared: every actor on every core (polyrl run --separate); split: rollout engines and "
        "workflow workers on half the cores, trainers on the other half, as pods have them "
        "(polyrl run --cpus)",
    )
    args = ap.parse_args()
    placements = PLACEMENTS if args.placement == "both" else (args.placement,)
    cpu_sets = {"shared": None, "split": split_cpus()}
    start_ray()
    runs: dict[str, dict[Mode, list[tuple[float, float, int]]]] = {
        p: {m: [] for m in MODES} for p in placements
    }
    for k in range(args.rounds):
        for place in placements:
            for mode, s in MODES:
                j = job(mode, s, args.steps, args.tail, args.episodes, alpha=args.alpha)
                got = measure(j, cpu_sets[place])
                if isinstance(got, str):
                    print(f"{place} {mode}/{s}: {got}", file=sys.stderr)
                    return 1
                runs[place][(mode, s)].append(got)
                rate, final, stale = got
                ratio = rate / runs[place][MODES[0]][k][0]
                print(
                    f"round {k + 1} {place:6} {mode:5} (maxStaleness {s}): {rate:6.2f} steps/s ({ratio:.2f}x "
                    f"sync of this round and placement)  final success {final:.2f}  max staleness {stale}",
                    flush=True,
                )
    print(
        f"\ncpus={os.cpu_count()} steps={args.steps} episodes/step={args.episodes} rounds={args.rounds} "
        f"reply tail: Pareto(alpha={args.alpha}) up to {args.tail} tokens"
    )
    for place in placements:
        sets = cpu_sets[place]
        where = " ".join(f"{r}={format_cpus(c)}" for r, c in sets.items()) if sets else "every core"
        print(f"\n{place} cores ({where}):")
        table(runs[place])
    if len(placements) == 2:
        best = {p: {m: statistics.median(r[0] for r in runs[p][m]) for m in MODES} for p in placements}
        sync_best = max(best[p][MODES[0]] for p in placements)
        async_best = max(best[p][m] for p in placements for m in MODES[1:])
        print(
            f"\nfastest async over fastest sync, any placement (medians): {async_best:.2f} / {sync_best:.2f} "
            f"= {async_best / sync_best:.2f}x"
        )
    stop_ray()
    return 0


if __name__ == "__main__":
    sys.exit(main())
