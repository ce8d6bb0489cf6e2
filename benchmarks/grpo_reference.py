"""A plain GRPO loop on the guessing task, the yardstick polyrl's learning is measured against.

`reference_run` is GRPO as a reader of the paper or of TRL would write it, in one process: sample a
group of one-token replies per prompt from the policy (logits over the task's allowed ids), advantages
normalised within each group ((r - mean_g) / (std_g + eps)), one on-policy step of torch AdamW on the
token-mean policy-gradient loss. Both sides start from the identical weights of `builtin://tiny-qwen2`
(built deterministically by `create_tiny_qwen2`), see the same prompts (the policy's tokenizer, the
same `see:D` text) and use the same batch, group size and learning rate.

    .venv/bin/python benchmarks/grpo_reference.py                 # 3 seeds, 40 steps, 64 episodes
    .venv/bin/python benchmarks/grpo_reference.py --steps 20 --episodes 32 --seeds 1
    .venv/bin/python benchmarks/grpo_reference.py --only polyrl --set advantageNorm='"none"'
    .venv/bin/python benchmarks/grpo_reference.py --dtype bfloat16 --first-seed 3 --seeds 1
    .venv/bin/python benchmarks/grpo_reference.py --dtype bfloat16 --only reference --reference-trainer polyrl

prints per seed the last-10 success of each and the ratio polyrl / reference, then the means.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).parent))
from polyrl_operator.api import RLJob
from polyrl_runtime.models import load_model, load_tokenizer

MODEL = "builtin://tiny-qwen2"
TAIL = 10


@dataclass(frozen=True)
class Task:
    """The guessing game: see digit D of `symbols`, answer the digit `shift` places on."""

    symbols: int = 4
    shift: int = 1
    steps: int = 40
    episodes: int = 64  # per step
    group: int = 8
    lr: float = 3e-3

    @property
    def digits(self) -> list[str]:
        return list(string.digits[: self.symbols])

    def answer(self, digit: str) -> str:
        d = self.digits
        return d[(d.index(digit) + self.shift) % len(d)]


def reference_run(
    task: Task, seed: int, model_uri: str = MODEL, dtype: str = "float32", trainer: str = "torch"
) -> list[float]:
    """Per-step success (before that step's update) of the plain loop. `trainer="polyrl"` keeps the
    loop's sampling and data but trains with polyrl's own parts (`PolyrlUpdate`): it separates the
    trainer's numerics from everything else polyrl does (engine, weight sync, workflow, driver)."""
    if trainer == "polyrl":
        return _reference_with_polyrl_trainer(task, seed, model_uri, dtype)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = load_tokenizer(model_uri)
    model = load_model(model_uri, dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=0.0)
    allowed = torch.tensor([tok.token_id(d) for d in task.digits])
    prompts = {d: torch.tensor(tok.encode(f"see:{d}", bos=True)) for d in task.digits}
    history = []
    for _ in range(task.steps):
        seen = [d for _ in range(task.episodes // task.group) for d in [rng.choice(task.digits)] * task.group]
        logits = model(torch.stack([prompts[d] for d in seen])).logits[:, -1]
        logp = torch.log_softmax(logits[:, allowed].float(), dim=-1)
        picks = torch.multinomial(logp.detach().exp(), 1)[:, 0].tolist()
        answers = [task.digits[i] for i in picks]
        reward = torch.tensor([float(a == task.answer(d)) for a, d in zip(answers, seen, strict=True)])
        reward = reward.view(-1, task.group)
        adv = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)
        loss = -(adv.flatten() * logp[torch.arange(len(picks)), picks]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(float(reward.mean()))
    return history


def _reference_with_polyrl_trainer(task: Task, seed: int, model_uri: str, dtype: str) -> list[float]:
    """The plain loop's sampling and data, trained by polyrl's DeepSpeed trainer as `build_trainer`
    makes it (ZeRO 1, clipping, bf16 master weights where the model is bf16), with polyrl's chunked
    log-probabilities, per-policy advantages of group-relative signals and its policy loss."""
    import numpy as np

    from polyrl_operator.api import Policy
    from polyrl_runtime.algorithms.advantages import advantages, scale_stats
    from polyrl_runtime.algorithms.estimators import normalisation
    from polyrl_runtime.algorithms.losses import LossConfig, TokenBatch, policy_loss, sequence_logprobs
    from polyrl_runtime.trainers.build import build_trainer

    _world_of_one()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = load_tokenizer(model_uri)
    policy = Policy.model_validate(
        {
            "name": "agent",
            "model": {"uri": model_uri, "dtype": dtype},
            "algorithm": {"name": "grpo", "groupSize": task.group, "lr": task.lr},
            "rollout": {"engine": "torch", "gpus": 0},
            "trainer": {"zeroStage": 1, "gpus": 0, "microBatchSize": task.episodes},
        }
    )
    engine = build_trainer(
        policy, seed=0, cuda=False, device=torch.device("cpu"), total_steps=task.steps
    ).engine
    engine.train()
    algo = policy.algorithm
    cfg = LossConfig.of(algo)
    allowed = [tok.token_id(d) for d in task.digits]
    allowed_np = np.array(allowed, np.int32)
    prompts = {d: np.array(tok.encode(f"see:{d}", bos=True), np.int32) for d in task.digits}
    history = []
    for _ in range(task.steps):
        seen = [d for _ in range(task.episodes // task.group) for d in [rng.choice(task.digits)] * task.group]
        with torch.no_grad():
            logits = engine(torch.from_numpy(np.stack([prompts[d] for d in seen])).long()).logits[:, -1]
            probs = torch.softmax(logits[:, allowed].float(), dim=-1)
        picks = torch.multinomial(probs, 1)[:, 0].tolist()
        reward = torch.tensor(
            [float(task.digits[i] == task.answer(d)) for i, d in zip(picks, seen, strict=True)]
        )
        groups = reward.view(-1, task.group)
        signals = (groups - groups.mean(1, keepdim=True)).flatten()
        adv = advantages(signals, normalisation(algo.name, algo.advantage_norm), scale_stats(signals))
        batch = TokenBatch.build(
            [prompts[d] for d in seen],
            [np.array([allowed[i]], np.int32) for i in picks],
            [allowed_np] * len(seen),
        )
        logp = sequence_logprobs(engine, batch)
        loss, _ = policy_loss(logp, logp.detach(), logp.detach(), adv, batch.response_mask, cfg=cfg)
        engine.backward(loss / len(seen))
        engine.step()
        history.append(float(reward.mean()))
    return history


def _world_of_one() -> None:
    """A one-rank gloo group in this process, which DeepSpeed needs to build an engine."""
    import torch.distributed as dist

    from polyrl_runtime.netmap import free_port
    from polyrl_runtime.trainers.deepspeed_import import import_deepspeed

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    os.environ.update(LOCAL_RANK="0")
    import_deepspeed().init_distributed(dist_backend="gloo")


def polyrl_job(
    task: Task, seed: int, model_uri: str = MODEL, dtype: str = "float32", **algorithm: Any
) -> RLJob:
    """The same task as a one-policy sync RLJob (torch engine, DeepSpeed trainer on CPU)."""
    return RLJob.model_validate(
        {
            "apiVersion": "polyrl.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "guessing-parity"},
            "spec": {
                "mode": "sync",
                "training": {"totalSteps": task.steps, "episodesPerStep": task.episodes, "seed": seed},
                "workflow": {
                    "entrypoint": "polyrl_runtime.workflows.guessing:Guessing",
                    "args": {"symbols": task.symbols, "shift": task.shift},
                },
                "policies": [
                    {
                        "name": "agent",
                        "model": {"uri": model_uri, "dtype": dtype},
                        "algorithm": {"name": "grpo", "groupSize": task.group, "lr": task.lr, **algorithm},
                        "rollout": {"engine": "torch", "gpus": 0},
                        "trainer": {"zeroStage": 1, "gpus": 0},
                    }
                ],
                "weightSync": {"transport": "objectstore"},
                "checkpoint": {"everySteps": 10_000},
            },
        }
    )


def polyrl_run(
    task: Task, seed: int, model_uri: str = MODEL, dtype: str = "float32", **algorithm: Any
) -> list[float]:
    """Per-step success of the polyrl job (needs a running Ray: `_jobs.start_ray`)."""
    from _jobs import run_job

    rows: list[float] = []
    summary = run_job(
        polyrl_job(task, seed, model_uri, dtype, **algorithm),
        lambda rec: rows.append(float(rec.success_mean)),
    )
    if summary.state != "done":
        raise RuntimeError(f"polyrl job failed: {summary.message}")
    return rows


def tail(history: Sequence[float], n: int = TAIL) -> float:
    return statistics.fmean(history[-n:])


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--symbols", type=int, default=4)
    ap.add_argument("--only", choices=["both", "reference", "polyrl"], default="both")
    ap.add_argument("--dtype", default="float32", help="the model's dtype on both sides")
    ap.add_argument("--curves", action="store_true", help="print every step's success too")
    ap.add_argument(
        "--reference-trainer",
        choices=["torch", "polyrl"],
        default="torch",
        help="what trains the reference loop: torch AdamW, or polyrl's DeepSpeed trainer, log-probabilities, "
        "advantages and loss (the trainer's numerics without the rest of polyrl)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="an algorithm field of the polyrl job (controlled experiments), e.g. advantageNorm='\"none\"'",
    )
    args = ap.parse_args(argv)
    overrides = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.set)}
    task = Task(args.symbols, 1, args.steps, args.episodes, args.group, args.lr)
    from _jobs import start_ray, stop_ray

    if args.only != "reference":
        start_ray()
    ref_tails, pol_tails = [], []
    try:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            line = f"seed {seed}:"
            if args.only != "polyrl":
                t0 = time.perf_counter()
                ref = reference_run(task, seed, MODEL, args.dtype, args.reference_trainer)
                ref_tails.append(tail(ref))
                line += f" reference {ref_tails[-1]:.3f} ({time.perf_counter() - t0:.0f} s)"
                if args.curves:
                    print("  reference", " ".join(f"{x:.2f}" for x in ref))
            if args.only != "reference":
                t0 = time.perf_counter()
                pol = polyrl_run(task, seed, MODEL, args.dtype, **overrides)
                pol_tails.append(tail(pol))
                line += f" polyrl {pol_tails[-1]:.3f} ({time.perf_counter() - t0:.0f} s)"
                if args.curves:
                    print("  polyrl   ", " ".join(f"{x:.2f}" for x in pol))
            if ref_tails and pol_tails:
                line += f" ratio {pol_tails[-1] / max(ref_tails[-1], 1e-9):.3f}"
            print(line, flush=True)
    finally:
        if args.only != "reference":
            stop_ray()
    chance = 1 / task.symbols
    summary = f"last-{TAIL} success (chance {chance:.2f}):"
    if ref_tails:
        summary += f" reference {statistics.fmean(ref_tails):.3f}"
    if pol_tails:
        summary += f" polyrl {statistics.fmean(pol_tails):.3f}"
    if ref_tails and pol_tails:
        summary += f" ratio {statistics.fmean(pol_tails) / statistics.fmean(ref_tails):.3f}"
    print(summary)


if __name__ == "__main__":
    main()
