"""A league against latest-only self-play: the same job (model, steps, seed) trained twice, once with
its league's sampling as the example says (pfsp by default) and once with `latest` (plain
self-play: snapshots kept, never drawn), each rated by cross-play against a fixed opponent (the
example's frozen base model, `evaluation.crossPlay`).

Per run: the current version's win rate against the fixed opponent at each cross-play pass (its
score, a draw counting half), the final one, the largest drop of that series (the largest fall from
a pass to a later one: non-monotonic drift), the rating of the newest version, and the mean reward of
the last steps:

    .venv/bin/python benchmarks/league_selfplay.py [--out runs/league-selfplay] [--set PATH=VALUE ...]
    .venv/bin/python benchmarks/league_selfplay.py --reuse   # read the runs already in --out

PATH is dotted under `spec` (`*`: every item of a list), VALUE is YAML, as example_robustness.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from example_robustness import EXAMPLES, apply_override

from polyrl_runtime.coordinator.crossplay import CROSSPLAY_FILE, read_cells

ROOT = Path(__file__).resolve().parents[1]
POLYRL = Path(sys.executable).with_name("polyrl")
LAST_STEPS = 3


def largest_drop(series: list[float]) -> float:
    """The largest fall from a value to a later one (0 for a series that never falls)."""
    drop, peak = 0.0, float("-inf")
    for x in series:
        peak = max(peak, x)
        drop = max(drop, peak - x)
    return drop


def summarise(out: Path, player: str, fixed: str) -> dict[str, Any]:
    cells = [c for c in read_cells(out / CROSSPLAY_FILE) if (c["row"], c["column"]) == (player, fixed)]
    newest: dict[int, dict[str, Any]] = {}
    for c in cells:  # the pass's newest row version: the current one
        if c["score"] is not None and c["row_version"] >= newest.get(c["step"], {}).get("row_version", -1):
            newest[c["step"]] = c
    passes = [(step, newest[step]["score"]) for step in sorted(newest)]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    mine = [r for r in rows if r["policy"] == player and r.get("reward_mean") is not None]
    tail = [r["reward_mean"] for r in mine[-LAST_STEPS:]]
    rated = [r for r in mine if r.get("rating") is not None]
    return {
        "passes": passes,
        "final": passes[-1][1] if passes else None,
        "drop": largest_drop([s for _, s in passes]),
        "rating": (rated[-1]["rated_version"], rated[-1]["rating"]) if rated else None,
        "reward": sum(tail) / len(tail) if tail else None,
        "wall_s": json.loads((out / "summary.json").read_text()).get("wall_s"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--example", default="tic-tac-toe-league-smollm2-lora-cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "league-selfplay")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    ap.add_argument("--reuse", action="store_true", help="summarise the runs in --out without training")
    args = ap.parse_args()
    doc = yaml.safe_load((EXAMPLES / f"{args.example}.yaml").read_text())
    for assignment in args.overrides:
        apply_override(doc["spec"], assignment)
    (player,) = [p["name"] for p in doc["spec"]["policies"] if p.get("league")]
    fixed = doc["spec"]["evaluation"]["crossPlay"]["anchor"]
    league = next(p["league"] for p in doc["spec"]["policies"] if p.get("league"))
    variants = {str(league.get("sampling", "uniform")): doc, "latest": yaml.safe_load(yaml.safe_dump(doc))}
    next(p for p in variants["latest"]["spec"]["policies"] if p.get("league"))["league"]["sampling"] = (
        "latest"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = {}
    for name, variant in variants.items():
        out = args.out / name
        if not args.reuse:
            out.mkdir(parents=True, exist_ok=True)
            job = out / "job.yaml"
            job.write_text(yaml.safe_dump(variant))
            cmd = [str(POLYRL), "run", str(job), "--out", str(out), "--plain"]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
                return 1
        results[name] = summarise(out, player, fixed)
    print(
        f"| sampling | win rate of {player} against {fixed} (step: score) | final | largest drop | rating (version) | reward, last {LAST_STEPS} steps | wall |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        passes = ", ".join(f"{s}: {x:.2f}" for s, x in r["passes"])
        rating = f"{r['rating'][1]:.0f} (v{r['rating'][0]})" if r["rating"] else "-"
        final = f"{r['final']:.2f}" if r["final"] is not None else "-"
        reward = f"{r['reward']:.3f}" if r["reward"] is not None else "-"
        print(
            f"| {name} | {passes} | {final} | {r['drop']:.2f} | {rating} | {reward} | {r['wall_s']:.0f} s |"
        )
    a, b = results[next(iter(variants))], results["latest"]
    if a["final"] is not None and b["final"] is not None:
        print(f"final win rate, league minus latest-only: {a['final'] - b['final']:+.2f}; "
              f"largest drop, league minus latest-only: {a['drop'] - b['drop']:+.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
