"""Every advantage estimator on the real-model task: held-out eval gain and stability, per seed.

SmolLM2-135M-Instruct (`builtin://smollm2-135m-instruct`) learns reasoning-gym's `basic_arithmetic`
(the task of `make run`), trained by polyrl as real_model.py trains it: an in-process `Driver`,
`PromptCompletion` with the chat template and the `reasoning_gym` reward on the last number, the
training rows without any question of the evaluation rows, and greedy pass@1 on `--eval-rows`
held-out questions before training and on the last step's export (real_model.py's functions).

Rows (`VARIANTS`): each is real_model.py's GRPO policy (`grpo_policy`: lr 1e-5 constant, clipEps
0.2, no KL, gradient norm 1.0, full weights, one DeepSpeed rank at ZeRO 0) with only its algorithm
changed. Every run has the same sample budget: `--steps` steps of `--prompts` questions x `--group`
samples trained, in micro-batches of one group. ppo, DAPO and GSPO take one clipped optimizer step
per group (ppo by default, DAPO and GSPO with `miniBatches` = the step's groups), all against the
proximal log-probabilities scored before the first: their clip ranges act from the second step on.
The other rows take one optimizer step per batch (ratio 1: clipping does not act). DAPO's
dynamic sampling plays more episodes in place of the equal-reward groups it drops (a run's line says
how many episodes it played beside the samples it trained), and its overlong penalty is part of the
reward its steps report.

Measured per run: eval gain (pass@1 after minus before) and stability. A run's reward curve is
averaged over windows of `window(steps)` consecutive steps (10, or a third of a run shorter than 30
steps); it is unstable when its last window's mean falls below its best window's by more than 0.2.

Goal (from the issue): Dr. GRPO or DAPO at least as good as today's GRPO on the mean eval gain, and
no row worse than 0.05 below GRPO's mean.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/algorithms.py      # 7 rows x 3 seeds, 20 steps of 16
    .venv/bin/python benchmarks/algorithms.py --seeds 1 --steps 2 --variants grpo,dr_grpo --eval-rows 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a script, this folder is on sys.path; real_model sets OMP_NUM_THREADS=1 and RAY_AUTH_MODE
# (unless set) as it is imported, before anything reads them.
from real_model import (  # type: ignore[import-not-found]
    base_pass_at_1,
    hyper,
    polyrl_side,
    task_arguments,
    task_rows,
)
from vs_trl import Hyper, grpo_policy  # type: ignore[import-not-found]

# Each row's `algorithm` fields over grpo_policy's; None removes the field (its default applies).
VARIANTS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dr_grpo": {"name": "dr_grpo", "advantageNorm": None},  # unset: none (no division by a std)
    "rloo": {"name": "rloo"},
    "reinforce_pp": {"name": "reinforce_pp"},
    "reinforce_pp_baseline": {"name": "reinforce_pp_baseline"},
    "ppo": {"name": "ppo"},
    # DAPO's final recipe shapes overlong replies (a soft penalty, its ramp over the last quarter
    # of maxNewTokens: variant_policy sets bufferTokens) rather than filtering them: SmolLM2 fills
    # all 32 new tokens in over half its replies here, and filtering those would multiply the
    # episodes a step plays.
    "dapo": {
        "miniBatches": "groups",
        "clipEpsHigh": 0.28,
        "dynamicSampling": {},
        "overlongPenalty": {"penaltyFactor": 1.0},
        "lossAggregation": "token-mean",
    },
    "gspo": {
        "miniBatches": "groups",
        "ratioLevel": "sequence",
        "lossAggregation": "seq-mean-token-mean",
        "clipEps": 3e-4,
        "clipEpsHigh": 4e-4,
    },
}
BASELINE = "grpo"  # today's default
CANDIDATES = ("dr_grpo", "dapo")  # at least one at least as good as the baseline on the mean
MARGIN = 0.05  # no row's mean gain more than this below the baseline's
DROP = 0.2  # unstable: the last window's mean reward more than this below the best window's
WINDOW = 10  # steps a window spans, in runs of at least 3 x WINDOW steps
GOAL = "Dr. GRPO or DAPO at least as good as today's GRPO on the mean, none worse than 0.05 below it"
# Gains and reward means are means of fractions: equal ones may differ by rounding alone.
EPS = 1e-9


@dataclass(frozen=True)
class Run:
    """One variant's training run on one seed."""

    variant: str
    seed: int
    before: float  # held-out greedy pass@1 of the base model
    after: float  # the same on the last step's export
    rewards: tuple[float, ...]  # per step; NaN: no rewarded episode reported in that step
    trained: int  # samples trained
    played: int  # episodes finished, those dropped included
    dropped: tuple[tuple[str, int], ...]  # samples dropped, by reason
    wall_s: float

    @property
    def gain(self) -> float:
        return self.after - self.before


def window(steps: int) -> int:
    """Steps per reward window: WINDOW, or a third of a shorter run (at least one step)."""
    return min(WINDOW, max(1, steps // 3))


def rolling(rewards: tuple[float, ...], span: int) -> list[float]:
    """The mean of each `span` consecutive steps' rewards (steps without a reward are skipped; a
    window of none is NaN)."""
    out = []
    for i in range(max(1, len(rewards) - span + 1)):
        seen = [r for r in rewards[i : i + span] if not math.isnan(r)]
        out.append(statistics.fmean(seen) if seen else math.nan)
    return out


def unstable(rewards: tuple[float, ...]) -> bool:
    """Whether the last window's mean reward is more than DROP below the best window's."""
    means = rolling(rewards, window(len(rewards)))
    seen = [m for m in means if not math.isnan(m)]
    return bool(seen) and means[-1] < max(seen) - DROP - EPS


def parse_variants(text: str) -> list[str]:
    """The `--variants` list, in its order; a ValueError naming the unknown ones otherwise."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"--variants: unknown {unknown or 'empty list'} (known: {', '.join(VARIANTS)})")
    return list(dict.fromkeys(names))


def variant_policy(h: Hyper, model: str, variant: str) -> dict[str, Any]:
    """grpo_policy's policy with `variant`'s algorithm fields, trained in micro-batches of a group
    (an overlong penalty's ramp: the last quarter of the new tokens; miniBatches "groups": one
    mini-batch per question of the step)."""
    policy: dict[str, Any] = grpo_policy(h, model)
    algorithm = {**policy["algorithm"], **VARIANTS[variant]}
    if "overlongPenalty" in algorithm:
        ramp = max(1, h.max_new_tokens // 4)  # below maxNewTokens (>= 2) as the API requires
        algorithm["overlongPenalty"] = {**algorithm["overlongPenalty"], "bufferTokens": ramp}
    if algorithm.get("miniBatches") == "groups":  # one optimizer step per group of the step
        algorithm["miniBatches"] = h.prompts
    policy["algorithm"] = {k: v for k, v in algorithm.items() if v is not None}
    policy["trainer"] = {**policy["trainer"], "microBatchSize": h.group}
    return policy


def goal(gains: dict[str, float]) -> str:
    """The issue's goal on each variant's mean gain: 'met', 'not met' or why it is not judged."""
    if BASELINE not in gains or not any(c in gains for c in CANDIDATES):
        return f"not judged: it needs {BASELINE} and one of {', '.join(CANDIDATES)}"
    base = gains[BASELINE]
    best = max(gains[c] for c in CANDIDATES if c in gains)
    worst = min(gains, key=lambda v: gains[v])
    met = best >= base - EPS and gains[worst] >= base - MARGIN - EPS
    return (
        f"{'met' if met else 'not met'} ({BASELINE} {base:+.3f}, best of "
        f"{'/'.join(c for c in CANDIDATES if c in gains)} {best:+.3f}, lowest {worst} {gains[worst]:+.3f})"
    )


def describe(r: Run) -> str:
    span = window(len(r.rewards))
    means = rolling(r.rewards, span)
    drops = ", ".join(f"{k} {v}" for k, v in r.dropped) or "none"
    return (
        f"{r.variant} seed {r.seed}: pass@1 {r.before:.3f} -> {r.after:.3f} ({r.gain:+.3f}); reward "
        f"first {means[0]:.3f}, last {means[-1]:.3f}, best {max(means):.3f} ({span}-step means): "
        f"{'unstable' if unstable(r.rewards) else 'stable'}; {r.trained} samples trained, {r.played} "
        f"episodes played (dropped: {drops}); {r.wall_s:.0f} s"
    )


def table(runs: list[Run]) -> list[str]:
    """The summary table (one row per variant, in the order run) and the goal line."""
    span = window(len(runs[0].rewards))
    lines = [
        f"| variant | mean eval gain (per seed) | unstable runs | mean reward, first / last {span} steps "
        "| mean episodes played / samples trained |",
        "|---|---|---|---|---|",
    ]
    gains: dict[str, float] = {}
    for variant in dict.fromkeys(r.variant for r in runs):
        mine = [r for r in runs if r.variant == variant]
        gains[variant] = statistics.fmean(r.gain for r in mine)
        first = statistics.fmean(rolling(r.rewards, span)[0] for r in mine)
        last = statistics.fmean(rolling(r.rewards, span)[-1] for r in mine)
        played = statistics.fmean(r.played / max(r.trained, 1) for r in mine)
        lines.append(
            f"| {variant} | {gains[variant]:+.3f} ({', '.join(f'{r.gain:+.3f}' for r in mine)}) "
            f"| {sum(unstable(r.rewards) for r in mine)} of {len(mine)} | {first:.3f} / {last:.3f} "
            f"| {played:.2f} |"
        )
    lines.append(f"goal: {GOAL}: {goal(gains)}")
    return lines


def train(
    h: Hyper,
    model: str,
    data_path: Path,
    held: list[dict[str, Any]],
    *,
    variant: str,
    before: float,
    mode: str,
) -> Run:
    """One polyrl run of `variant` on the rows at `data_path`; `before` is the base model's pass@1."""
    played: list[int] = []
    dropped: Counter[str] = Counter()

    def count(rec: Any) -> None:
        played.append(int(rec.episodes))
        dropped.update({k: int(v) for k, v in rec.dropped.items() if v})

    t0 = time.perf_counter()
    [side] = polyrl_side(
        h, model, data_path, held, ["solver"], mode=mode, policy=variant_policy(h, model, variant), also=count
    ).values()
    return Run(
        variant,
        h.seed,
        before,
        side.after,
        tuple(side.rewards),
        sum(side.samples),
        sum(played),
        tuple(sorted(dropped.items())),
        time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    task_arguments(ap, steps=20, mode="sync")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"a comma list of {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    try:
        variants = parse_variants(args.variants)
    except ValueError as e:
        ap.error(str(e))
    for name in ("steps", "seeds", "eval_rows", "prompts", "group"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    from _jobs import start_ray, stop_ray  # type: ignore[import-not-found]

    from polyrl_runtime.models import model_dir

    where = Path(model_dir(args.model))  # converted once (cached): every run loads this directory
    h0 = hyper(args, args.first_seed)
    print(
        f"# {len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.1f} at start, mode "
        f"{args.mode}, model {where}; each run {h0.steps} steps x {h0.batch} samples, "
        f"eval on {args.eval_rows} held-out questions"
    )
    runs: list[Run] = []
    start_ray()
    try:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            h = hyper(args, seed)
            train_rows, held = task_rows(seed, args.eval_rows)
            before = base_pass_at_1(where, held, h.max_new_tokens)
            with tempfile.TemporaryDirectory() as tmp:
                data_path = Path(tmp) / "train.jsonl"
                data_path.write_text("".join(json.dumps(r) + "\n" for r in train_rows))
                for variant in variants:
                    runs.append(
                        train(h, args.model, data_path, held, variant=variant, before=before, mode=args.mode)
                    )
                    print(describe(runs[-1]), flush=True)
    finally:
        stop_ray()
    print()
    for line in table(runs):
        print(line)


if __name__ == "__main__":
    main()
