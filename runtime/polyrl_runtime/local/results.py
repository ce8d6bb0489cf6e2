"""The result files of `polyrl run` and the summary it prints.

The output folder holds `metrics.jsonl` (the driver's series, continued by a resume), `metrics.csv`,
`reward_<policy>.png`, `summary.json` and `checkpoints/`. `summary.json` describes the results in the
folder. A run changes the folder only once it has started (every actor up, the starting weights on
the engines): one that fails before leaves the previous results as they were, `summary.json`
included, and writes its own summary to `summary.failed.json`, which the next run that starts
removes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from polyrl_runtime.coordinator.crossplay import CROSSPLAY_FILE, read_cells
from polyrl_runtime.coordinator.metrics.files import LOCAL_NAME, read_metrics
from polyrl_runtime.coordinator.metrics.startup import StartupPhases
from polyrl_runtime.coordinator.report import RunSummary
from polyrl_runtime.local.plots import crossplay_heatmaps, reward_curves, write_csv

SUMMARY = "summary.json"
FAILED_START = "summary.failed.json"
CSV = "metrics.csv"
TAIL_STEPS = 10  # the summary's "last steps" mean: one step's 64 episodes are a noisy reading


def clear_previous(out: Path, root: Path | str, *, fresh: bool) -> None:
    """What a run that has started removes: the summary of a failed start and, starting afresh, the
    previous run's results (its metrics series is the driver's to restart)."""
    (out / FAILED_START).unlink(missing_ok=True)
    if not fresh:
        return
    for name in (CSV, SUMMARY, CROSSPLAY_FILE):
        (out / name).unlink(missing_ok=True)
    for png in [*out.glob("reward_*.png"), *out.glob("crossplay_*.png")]:
        png.unlink()
    if root == out / "checkpoints" and root.exists():
        shutil.rmtree(root)


def tail_means(rows: list[dict[str, Any]], policy: str, n: int = TAIL_STEPS) -> dict[str, Any]:
    """Mean reward and success of `policy` over its last `n` steps (fewer if it has fewer)."""
    tail = [r for r in rows if r["policy"] == policy][-n:]
    out: dict[str, Any] = {"steps": len(tail)}
    for key in ("reward_mean", "success_mean"):
        vals = [float(r[key]) for r in tail if r.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals else None
    return out


@dataclass(frozen=True)
class Results:
    """What `write_results` wrote: the summary's file and the result files that exist."""

    summary_file: Path
    files: list[Path]  # metrics.jsonl, metrics.csv, crossplay.jsonl: only those there are
    plots: list[Path]
    tails: dict[str, dict[str, Any]]


def write_results(out: Path, summary: RunSummary, *, started: bool) -> Results:
    """The run's result files from the metrics series in `out`, then its summary (see the module
    docstring for where a run that never started writes it)."""
    doc = asdict(summary)
    doc.pop("records")
    if not started:
        path = out / FAILED_START
        path.write_text(json.dumps(doc, indent=1, default=str))
        return Results(path, [], [], {})
    rows = read_metrics(out)
    if rows:
        write_csv(out / CSV, rows)
    cells = read_cells(out / CROSSPLAY_FILE)
    plots = [*reward_curves(out, rows), *crossplay_heatmaps(out, cells)]
    tails = {p: tail_means(rows, p) for p in summary.steps}
    files = [out / name for name in (LOCAL_NAME, CSV, CROSSPLAY_FILE) if (out / name).is_file()]
    doc["last_steps_mean"] = tails
    doc["files"] = [f.name for f in [*files, *plots]]
    path = out / SUMMARY
    path.write_text(json.dumps(doc, indent=1, default=str))
    return Results(path, files, plots, tails)


def _with_tail(text: str, tail: dict[str, Any], key: str, fmt: str) -> str:
    value = tail.get(key)
    if tail["steps"] > 1 and value is not None:
        return f"{text} (mean of the last {tail['steps']} steps: {value:{fmt}})"
    return text


def _value(x: float | None, fmt: str) -> str:
    return "-" if x is None else f"{x:{fmt}}"


def summary_lines(s: RunSummary, res: Results) -> list[str]:
    """The summary `polyrl run` prints at the end."""
    lines = ["", f"== {s.state}: {s.message} ({s.wall_s:.0f}s, {s.episodes} episodes)"]
    if s.startup:
        lines.append(f"   start-up: {StartupPhases(dict(s.startup)).describe()}")
    for p, step in s.steps.items():
        tail = res.tails.get(p, {"steps": 0})
        first, last = _value(s.first_reward.get(p), ".3f"), _value(s.last_reward.get(p), ".3f")
        last = _with_tail(last, tail, "reward_mean", ".3f")
        succ = ""
        f_succ, l_succ = s.first_success.get(p), s.last_success.get(p)
        if f_succ is not None and l_succ is not None:
            succ = _with_tail(f", success {f_succ:.2f} -> {l_succ:.2f}", tail, "success_mean", ".2f")
        dropped = ", ".join(f"{k} {v}" for k, v in s.dropped.get(p, {}).items() if v) or "none"
        lines.append(f"   {p}: {step} steps, reward {first} -> {last}{succ}; dropped samples: {dropped}")
    if s.failed:
        lines.append("   failed episodes: " + ", ".join(f"{k} {v}" for k, v in s.failed.items()))
    if res.files:
        lines.append(f"   metrics: {', '.join(str(f) for f in res.files)}")
    lines += [f"   plot:    {png}" for png in res.plots]
    if s.checkpoint:
        lines.append(f"   checkpoint: {s.checkpoint}")
    if res.summary_file.name == FAILED_START:
        previous = res.summary_file.with_name(SUMMARY)
        kept = f"; the previous results are unchanged ({previous})" if previous.is_file() else ""
        lines.append(f"   summary: {res.summary_file} (the run failed before it started{kept})")
    else:
        lines.append(f"   summary: {res.summary_file}")
    return lines
