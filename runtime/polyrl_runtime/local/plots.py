"""Reward-curve PNGs (one per policy) and the metrics files of a local run."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    keys: list[str] = []
    for r in rows:
        keys.extend(k for k in r if k not in keys)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)


def _smooth(values: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= k:
            acc -= values[i - k]
        out.append(acc / min(i + 1, k))
    return out


def reward_curves(out_dir: Path, rows: Sequence[dict[str, Any]]) -> list[Path]:
    """One PNG per policy: reward (and success, when the workflow reports it) per step, and the
    evaluation passes' reward and pass@k when the job evaluates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for policy in sorted({r["policy"] for r in rows}):
        mine = [r for r in rows if r["policy"] == policy and r.get("reward_mean") is not None]
        if not mine:
            continue
        steps = [int(r["step"]) for r in mine]
        rewards = [float(r["reward_mean"]) for r in mine]
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        ax.plot(steps, rewards, alpha=0.35, label="reward (per step)")
        ax.plot(steps, _smooth(rewards, max(1, len(rewards) // 12)), label="reward (smoothed)")
        success = [r.get("success_mean") for r in mine]
        if all(s is not None for s in success):
            ax.plot(
                steps,
                _smooth([float(s) for s in success if s is not None], max(1, len(success) // 12)),
                linestyle="--",
                label="success (smoothed)",
            )
        # the eval passes, the one before training (step 0, no reward of its own) among them
        evals = [r for r in rows if r["policy"] == policy and r.get("eval_reward_mean") is not None]
        if evals:  # spec.evaluation: the eval passes' mean reward and pass@k on the eval rows
            ax.plot(
                [int(r["step"]) for r in evals],
                [float(r["eval_reward_mean"]) for r in evals],
                "o-",
                label="eval reward",
            )
            passes = [r for r in evals if r.get("eval_pass_at_k") is not None]
            ax.plot(
                [int(r["step"]) for r in passes],
                [float(r["eval_pass_at_k"]) for r in passes],
                "s:",
                label="eval pass@k",
            )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("mean episode reward")
        ax.set_title(f"policy {policy}")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        path = out_dir / f"reward_{policy}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def crossplay_heatmaps(out_dir: Path, cells: Sequence[dict[str, Any]]) -> list[Path]:
    """One PNG per cross-play pair (`crossplay_<row>_<column>.png`), from each version pair's latest
    cell (crossplay.jsonl's lines, in order): the row version's score against the column version
    (a game's win rate), and each side's mean reward (what a solver and a verifier each earn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("score", "score of row", (0.0, 1.0)),
        ("row_reward", "row reward", None),
        ("column_reward", "column reward", None),
    )
    written = []
    for pair in sorted({(c["row"], c["column"]) for c in cells}):
        latest = {
            (c["row_version"], c["column_version"]): c for c in cells if (c["row"], c["column"]) == pair
        }
        rows = sorted({r for r, _ in latest})
        cols = sorted({c for _, c in latest})
        fig, axes = plt.subplots(1, 3, figsize=(3.0 + 2.1 * len(cols), 1.2 + 0.6 * len(rows)), dpi=100)
        for ax, (key, title, limits) in zip(axes, panels, strict=True):
            grid = [[latest[(r, c)][key] if (r, c) in latest else None for c in cols] for r in rows]
            values = [[float("nan") if v is None else float(v) for v in line] for line in grid]
            vmin, vmax = limits or (None, None)
            image = ax.imshow(values, vmin=vmin, vmax=vmax, cmap="RdYlGn", aspect="auto")
            for i, line in enumerate(grid):
                for j, v in enumerate(line):
                    ax.text(j, i, "-" if v is None else f"{v:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(cols)), [f"v{c}" for c in cols])
            ax.set_yticks(range(len(rows)), [f"v{r}" for r in rows])
            ax.set_xlabel(f"{pair[1]} version" + (" (as opponent)" if pair[0] == pair[1] else ""))
            ax.set_ylabel(f"{pair[0]} version")
            ax.set_title(title)
            fig.colorbar(image, ax=ax)
        fig.suptitle(f"cross-play: {pair[0]} (rows) against {pair[1]} (columns)")
        fig.tight_layout()
        path = out_dir / f"crossplay_{pair[0]}_{pair[1]}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
