"""One policy's trainer failure on this machine's CPU: how long the others stall, what the failed one loses.

A two-policy job (speaker/listener signalling game, each episode waiting `--latency` seconds on its
environment, as a tool call would) trains `--steps` steps with a checkpoint every `--every` steps.
Once the speaker has passed step `--kill-at` and a checkpoint exists, its trainer rank is killed
(what a lost trainer pod does to it). The speaker's trainer restarts alone from its part of the
latest checkpoint (coordinator/policy_restart.py) while the listener trains on. Printed:

  the listener's longest gap between two steps, against its median step interval (1.0: no stall
  beyond the run's usual jitter), over the whole run and over the speaker's restart;
  the listener's steps during the restart;
  the speaker's restart time (failure to first publish of the restarted trainer), against its
  median step interval, and the steps it lost (those since its checkpoint).

    .venv/bin/python benchmarks/policy_restart.py [--steps 24] [--every 4] [--kill-at 9] [--latency 0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _jobs import start_ray, stop_ray, tiny_job

from polyrl_runtime.coordinator.driver import Driver, DriverOptions
from polyrl_runtime.coordinator.report import RunSummary


def _intervals(stamps: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(stamps)]


def measure(steps: int, every: int, kill_at: int, latency: float, episodes: int) -> dict[str, Any]:
    workflow = {
        "entrypoint": "polyrl_runtime.workflows.signal:SignalGame",
        "args": {"vocab": 8, "symbols": 4, "latency_s": latency},
    }
    job = tiny_job("bench-restart", ["speaker", "listener"], workflow, steps=steps, episodes=episodes, seed=7)
    job.spec.checkpoint.every_steps = every
    events: list[tuple[float, str, dict[str, Any]]] = []
    records: list[tuple[float, str, int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        opts = DriverOptions(
            out_dir=Path(tmp),
            checkpoint_root=Path(tmp) / "ckpt",
            place_by_resource=False,
            on_event=lambda kind, data: events.append((time.monotonic(), kind, data)),
            on_record=lambda rec: records.append((time.monotonic(), rec.policy, rec.step)),
        )
        driver = Driver(job, opts)

        async def scenario() -> RunSummary:
            task = asyncio.create_task(driver.run())
            while not (
                "speaker" in driver.runs
                and driver.runs["speaker"].step >= kill_at
                and driver.last_ckpt is not None
            ):
                if task.done():
                    raise SystemExit(
                        f"the job ended before the speaker's step {kill_at}: {task.result().message}"
                    )
                await asyncio.sleep(0.05)
            driver.runs["speaker"].ranks[0].kill()
            return await task

        summary = asyncio.run(scenario())
    if summary.state != "done":
        raise SystemExit(f"the job did not finish: {summary.message}")
    failed = next(t for t, k, _ in events if k == "policy_restarting")
    restarted, resumed = next((t, d) for t, k, d in events if k == "policy_restarted")
    listener = [t for t, p, _ in records if p == "listener"]
    speaker = [t for t, p, _ in records if p == "speaker"]
    steps_at_failure = max(s for t, p, s in records if p == "speaker" and t < failed)
    around = [t for t in listener if t < failed][-1:] + [t for t in listener if failed <= t <= restarted]
    around += [t for t in listener if t > restarted][:1]
    step_s = statistics.median(_intervals(listener))
    return {
        "listener_step_s": step_s,
        "longest_gap": max(_intervals(listener)) / step_s,
        "restart_gap": max(_intervals(around)) / step_s,
        "listener_steps_during": sum(1 for t in listener if failed < t < restarted),
        "restart_s": restarted - failed,
        "speaker_step_s": statistics.median(_intervals(speaker)),
        "lost": steps_at_failure - int(resumed["step"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4, help="checkpoint.everySteps")
    ap.add_argument("--kill-at", type=int, default=9, help="kill the speaker's rank once past this step")
    ap.add_argument(
        "--latency", type=float, default=0.3, help="seconds each episode waits on its environment"
    )
    ap.add_argument("--episodes", type=int, default=16, help="episodes per step")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: only checks that the figures come out")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.every, a.kill_at, a.latency, a.episodes = 8, 2, 3, 0.1, 8
    start_ray()
    try:
        m = measure(a.steps, a.every, a.kill_at, a.latency, a.episodes)
    finally:
        stop_ray()
    out = sys.stdout
    out.write(
        f"two policies, {a.steps} steps of {a.episodes} episodes ({a.latency} s environment latency), "
        f"checkpoint every {a.every}, speaker's rank killed past step {a.kill_at}\n\n"
    )
    out.write("| measure | value |\n|---|---|\n")
    out.write(f"| listener: median step interval | {m['listener_step_s']:.2f} s |\n")
    out.write(f"| listener: longest gap / median step, whole run | {m['longest_gap']:.2f} |\n")
    out.write(f"| listener: longest gap / median step, around the restart | {m['restart_gap']:.2f} |\n")
    out.write(f"| listener: steps during the speaker's restart | {m['listener_steps_during']} |\n")
    out.write(f"| speaker: restart time | {m['restart_s']:.1f} s |\n")
    out.write(f"| speaker: restart time / its median step | {m['restart_s'] / m['speaker_step_s']:.1f} |\n")
    out.write(f"| speaker: steps lost (since its checkpoint) | {m['lost']} |\n")


if __name__ == "__main__":
    main()
