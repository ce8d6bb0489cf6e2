"""polyrl against TRL's `GRPOTrainer` on CPU: one policy, then two, on the same GRPO task.

The task is a prompt dataset generated here (`repeat: 7` -> answer `7`) written as JSONL and read by
polyrl through `spec.data.train` (file://) and by TRL as a `datasets.Dataset` of the same rows. Both
sides score a completion with polyrl's built-in `numeric` reward (rewards/builtins.py: the last number
in the completion equals the row's answer) — the very same function object, called by TRL as a
`reward_funcs` entry. Both load the same Hugging Face model directory (`create_tiny_qwen2`, a random
init Qwen2 with a byte-level BPE tokenizer) in float32.

What is held equal (so the comparison measures the systems, not their settings):
- the work: per step `prompts` rows x `group` completions (TRL `per_device_train_batch_size` =
  prompts x group, `num_generations` = group, one generation per optimizer step); at most
  `max_new_tokens` new tokens per completion (TRL `max_completion_length`), both stopping at eos;
  temperature, top_p 1, no top_k; the same number of steps. Tokens/s counts the completion tokens
  each side actually generated and trained on, so a side that stops earlier is not credited for it.
- the update: torch AdamW (betas 0.9/0.999, weight decay 0), constant learning rate, gradient norm
  clipped at 1.0, clipped ratio loss with eps 0.2, loss averaged over every completion token of the
  step (TRL `loss_type="dapo"`, polyrl's token mean), group-mean baselines scaled by the std over the
  step's batch (TRL `scale_rewards="batch"`, polyrl `advantageNorm: per-policy`), no KL (TRL
  `beta=0`, polyrl `klCoef: 0`), no entropy bonus.
- the machine: OMP_NUM_THREADS=1 and nice 0 in every process. polyrl runs its actors (engine, trainer,
  workflow worker) as separate processes over every core (`polyrl run --separate`); TRL is one process
  whose torch threads are set with `torch.set_num_threads`: alone it runs once with 1 thread and once
  with every core, and the faster is TRL's figure for one policy (on a loaded machine more intra-op
  threads can be slower); the two runs one after the other use that thread count; two runs side by
  side get half the cores each.
- the clock: throughput is measured from the end of each side's first step to the end of its last
  (samples and tokens of steps 2..N over that time), so model loading, Ray start-up and the first
  step's warm-up count for neither; the start-up time is printed separately.
- the trainer: one rank per policy, so DeepSpeed at ZeRO stage 0 (there is nothing to partition;
  TRL's run has no ZeRO either).
- the cost: besides throughput, each side's CPU time per sample over the same steps (TRL: its
  process, every thread; polyrl: the driver and every process below it, Ray's included), and the
  cores each kept busy. TRL's CPU-ms per sample over polyrl's is the throughput ratio the two would
  reach if both kept every core busy: a side can overlap its work, not undo its cost.
polyrl runs as configured by default (async, maxStaleness 2); `--mode sync` runs it on-policy.

    .venv/bin/python benchmarks/vs_trl.py                     # 20 steps, 1 seed (a few minutes)
    .venv/bin/python benchmarks/vs_trl.py --steps 30 --seeds 2 --mode sync
    .venv/bin/python benchmarks/vs_trl.py --mode sync --pool  # polyrl's roles on one device pool

prints one table per seed (samples/s, tokens/s, reward of the last `--tail` steps, polyrl / TRL) and
the goals: 1.5x TRL's throughput for one policy and 2x for two, at equal or better reward. With
`--pool` every rollout and trainer of polyrl's job shares one device pool (each step a turn of the
pool scheduler: the engines sleep, the trainer trains, then they wake and load its weights), and the
goals are the CPU ones: throughput >= 1.0x TRL's in every case, and for one policy CPU-ms per sample
<= 1.1x TRL's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from polyrl_runtime.netmap import free_port
from polyrl_runtime.workflows.api import EpisodeContext, Outcome, Workflow

HERE = Path(__file__).resolve().parent
REWARD = "numeric"
GOALS = {"one policy": 1.5, "two policies, one after the other": 2.0, "two policies, side by side": 2.0}
# `--pool`: polyrl's policies colocated on one device pool, each step a turn of the pool scheduler,
# as TRL's one process generates then trains; the goals for CPU (the 1.5x and 2x stand for GPUs).
POOLED_GOALS = dict.fromkeys(GOALS, 1.0)
POOLED_CPU_GOAL = 1.1  # one policy: polyrl's CPU-ms per sample at most 1.1x TRL's


@dataclass(frozen=True)
class Hyper:
    """The settings both sides share."""

    steps: int = 20
    prompts: int = 4  # rows per step; each played by `group` completions
    group: int = 8
    lr: float = 1e-3
    max_new_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0

    @property
    def batch(self) -> int:
        return self.prompts * self.group


@dataclass
class Result:
    """One side's run of one policy: per-step timestamps (end of step), samples, tokens, rewards."""

    ends: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    startup_s: float = 0.0
    cpu_s: float = 0.0  # CPU-seconds the side's processes used from the end of step 1 to the last's
    cpu_ms_by_role: dict[str, float] = field(default_factory=dict)  # polyrl: CPU-ms per sample by process

    def work(self) -> int:
        """Samples of steps 2..N: what the clock and the CPU time are divided by."""
        return sum(self.samples[1:])

    def rate(self, what: str) -> float:
        """Per second over steps 2..N (the first step's end is the clock's start)."""
        per_step = self.samples if what == "samples" else self.tokens
        span = self.ends[-1] - self.ends[0]
        return sum(per_step[1:]) / span if len(self.ends) > 1 and span > 0 else float("nan")

    def reward(self, tail: int) -> float:
        """Mean over the last `tail` steps that had rewarded episodes (NaN marks a step without)."""
        seen = [r for r in self.rewards[-tail:] if not math.isnan(r)]
        return statistics.fmean(seen) if seen else float("nan")


def rows(n: int, seed: int) -> list[dict[str, str]]:
    """The task's rows: `repeat: D` with answer D, digits 0..4 in an order drawn from `seed`."""
    import random

    rng = random.Random(seed)
    return [{"prompt": f"repeat: {d}", "answer": d} for d in (str(rng.randrange(5)) for _ in range(n))]


def write_rows(path: Path, data: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return path


# -- TRL ---------------------------------------------------------------------------------------------


def trl_run(h: Hyper, model_dir: Path, data_path: Path, threads: int) -> Result:
    """One `GRPOTrainer.train()` of this task on CPU with `threads` torch threads (in its own process)."""
    from polyrl_runtime.rewards.load import load_reward

    score = load_reward(REWARD)

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float | None]:
        return [float(score(c, {"answer": a})) for c, a in zip(completions, answer, strict=True)]

    data = [json.loads(line) for line in data_path.read_text().splitlines()]
    return trl_train(h, model_dir, data, reward, threads)


def trl_train(
    h: Hyper,
    model_dir: Path,
    data: list[dict[str, Any]],
    reward: Any,
    threads: int,
    *,
    finish: Any = None,
) -> Result:
    """`GRPOTrainer.train()` on CPU with `threads` torch threads: `data` rows (the dataset's columns
    reach `reward` as keyword arguments), the settings both sides share (the module docstring);
    `finish(trainer)` runs after training, before the trainer's scratch folder goes."""
    import importlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    trl: Any = importlib.import_module("trl")
    datasets: Any = importlib.import_module("datasets")

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    out = Result()
    cpu_first = 0.0

    class Clock(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            nonlocal cpu_first
            if logs and "reward" in logs:
                if not out.ends:
                    cpu_first = time.process_time()  # every thread of this process
                out.cpu_s = time.process_time() - cpu_first
                out.ends.append(time.perf_counter())
                out.samples.append(h.batch)
                out.tokens.append(round(float(logs["completions/mean_length"]) * h.batch))
                out.rewards.append(float(logs["reward"]))

    with tempfile.TemporaryDirectory() as tmp:
        config = trl.GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            seed=h.seed,
            max_steps=h.steps,
            per_device_train_batch_size=h.batch,
            num_generations=h.group,
            max_completion_length=h.max_new_tokens,
            temperature=h.temperature,
            top_p=1.0,
            top_k=0,
            learning_rate=h.lr,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=1.0,
            epsilon=0.2,
            beta=0.0,
            loss_type="dapo",
            scale_rewards="batch",
            num_iterations=1,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = trl.GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            processing_class=AutoTokenizer.from_pretrained(model_dir, padding_side="left"),
            reward_funcs=reward,
            args=config,
            train_dataset=datasets.Dataset.from_list(data),
            callbacks=[Clock()],
        )
        out.startup_s = time.perf_counter() - t0
        trainer.train()
        if finish is not None:
            finish(trainer)
    return out


def _trl_command(h: Hyper, model_dir: Path, data_path: Path, threads: int) -> list[str]:
    spec = json.dumps(
        {"hyper": asdict(h), "model": str(model_dir), "data": str(data_path), "threads": threads}
    )
    return [sys.executable, str(Path(__file__).resolve()), "--trl-worker", spec]


def trl_processes(h: Hyper, model_dir: Path, data_path: Path, threads: int, n: int) -> list[Result]:
    """`n` TRL runs as concurrent processes (n=1: one run); each prints its Result as JSON."""
    runs = worker_processes([_trl_command(h, model_dir, data_path, threads)] * n, "TRL run")
    return [Result(**r) for r in runs]


def worker_processes(commands: list[list[str]], what: str) -> list[dict[str, Any]]:
    """Run `commands` as concurrent processes; each prints a JSON object as its last line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = []
    for command in commands:
        # Each process rendezvouses (torch.distributed, under TRL's accelerate) on a port of its own:
        # one inherited from this process (a trainer of a polyrl run set MASTER_PORT) may be taken.
        env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise SystemExit(f"{what} failed (exit {p.returncode}):\n{stderr.decode()[-3000:]}")
        results.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return results


# -- polyrl ------------------------------------------------------------------------------------------


def grpo_policy(h: Hyper, uri: str) -> dict[str, Any]:
    """A polyrl policy of model `uri` with the settings TRL's run shares (the module docstring)."""
    return {
        "model": {"uri": uri, "dtype": "float32"},
        "algorithm": {
            "name": "grpo",
            "groupSize": h.group,
            "lr": h.lr,
            "advantageNorm": "per-policy",
            "clipEps": 0.2,
            "klCoef": 0.0,
            "maxGradNorm": 1.0,
        },
        "rollout": {
            "engine": "torch",
            "gpus": 0,
            "sampling": {"temperature": h.temperature, "topP": 1.0, "maxNewTokens": h.max_new_tokens},
        },
        "trainer": {"zeroStage": 0, "gpus": 0, "microBatchSize": h.batch},
    }


def polyrl_job(
    h: Hyper, model_dir: Path, data_path: Path, policies: list[str], mode: str, *, pool: bool
) -> Any:
    """One job: one policy plays `PromptCompletion`; two play `PairedCompletion` (below), each policy
    answering every row on its own, so each gets the same samples per step as one TRL run. `pool`:
    every rollout and trainer on one CPU pool."""
    from polyrl_operator.api import RLJob

    if len(policies) == 1:
        workflow = {
            "entrypoint": "polyrl_runtime.workflows.prompts:PromptCompletion",
            "args": {"reward": REWARD, "agent": policies[0], "max_new_tokens": h.max_new_tokens},
        }
    else:
        workflow = {"entrypoint": "vs_trl:PairedCompletion", "args": {"max_new_tokens": h.max_new_tokens}}
    policy = grpo_policy(h, f"file://{model_dir}")
    pools = None
    if pool:
        pools = [{"name": "shared", "gpus": 0}]
        for role in ("rollout", "trainer"):
            policy[role] = {k: v for k, v in policy[role].items() if k != "gpus"} | {"pool": "shared"}
    return RLJob.model_validate(
        {
            "apiVersion": "polyrl.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "vs-trl"},
            "spec": {
                "mode": mode,
                "training": {"totalSteps": h.steps, "episodesPerStep": h.batch, "seed": h.seed},
                "data": {"train": f"file://{data_path}", "shuffle": True},
                "workflow": workflow,
                "policies": [{"name": n, **policy} for n in policies],
                "weightSync": {"transport": "objectstore"},
                "checkpoint": {"everySteps": 10_000},
                **({"pools": pools} if pools else {}),
            },
        }
    )


# The job's processes by what they run (Ray names an actor's process `ray::<class>`).
ROLES = {
    "ray::TorchEngine": "engines",
    "ray::DeepSpeedTrainer": "trainers",
    "ray::WorkflowWorker": "workflow workers",
    "ray::ExperienceService": "experience buffer",
}


def job_cpu_s() -> Counter[str]:
    """CPU-seconds used so far by this process (the driver) and every process below it, by role:
    the job's actors, and Ray's own processes (GCS, raylet, agents)."""
    import psutil  # type: ignore[import-untyped]

    me = psutil.Process()
    used: Counter[str] = Counter()
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            name = (proc.cmdline()[:1] or [""])[0].split(".")[0]
            used["driver" if proc.pid == me.pid else ROLES.get(name, "Ray")] += t.user + t.system
    return used


def polyrl_run(
    h: Hyper, model_dir: Path, data_path: Path, policies: list[str], mode: str, *, pool: bool
) -> dict[str, Result]:
    """One in-process `Driver` run (benchmarks/_jobs.py, as `polyrl run --separate` does) of the job."""
    return measure_job(polyrl_job(h, model_dir, data_path, policies, mode, pool=pool), policies, h.steps)


def measure_job(
    job: Any,
    policies: list[str],
    steps: int,
    checkpoint_root: Path | None = None,
    also: Callable[[Any], None] | None = None,
) -> dict[str, Result]:
    """Each policy's steps of one in-process run of `job`, timed as TRL's are. The job's CPU time
    (from the first step's end to the last's) is shared among the policies by their samples;
    `checkpoint_root` keeps the job's exports; `also` sees every step record after they are timed."""
    from _jobs import run_job  # type: ignore[import-not-found]

    results = {p: Result() for p in policies}
    t0 = time.perf_counter()
    cpu: list[Counter[str]] = []

    def on_record(rec: Any) -> None:
        r = results[rec.policy]
        if not r.ends:
            r.startup_s = time.perf_counter() - t0
        r.ends.append(time.perf_counter())
        r.samples.append(int(rec.samples))
        r.tokens.append(int(rec.tokens))
        r.rewards.append(float(rec.reward_mean) if rec.reward_mean is not None else float("nan"))
        if not cpu or all(len(x.ends) >= steps for x in results.values()):
            cpu.append(job_cpu_s())  # read at the first step's end and once every policy is done
        if also is not None:
            also(rec)

    summary = run_job(job, on_record, checkpoint_root=checkpoint_root)
    if summary.state != "done":
        raise SystemExit(f"polyrl run ended {summary.state}: {summary.message}")
    work = sum(r.work() for r in results.values())
    used = cpu[-1] - cpu[0]
    for r in results.values():
        r.cpu_s = sum(used.values()) * r.work() / max(work, 1)
        r.cpu_ms_by_role = {k: 1000 * v / max(work, 1) for k, v in used.most_common()}
    return results


class PairedCompletion(Workflow):
    """Both policies (agents `a` and `b`) answer the group's row at once; each is rewarded on its own."""

    def __init__(self, max_new_tokens: int | None = None) -> None:
        super().__init__()
        self.max_new_tokens = max_new_tokens

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        if ctx.sample is None:
            raise ValueError("PairedCompletion plays rows of spec.data.train, and the job has no spec.data")
        prompt = str(ctx.sample["prompt"])
        agents = ("a", "b")
        replies = await asyncio.gather(
            *(ctx.agent(a).generate(prompt, max_new_tokens=self.max_new_tokens) for a in agents)
        )
        rewards = {a: ctx.reward(REWARD, r.text) for a, r in zip(agents, replies, strict=True)}
        return Outcome(rewards, {"success": statistics.fmean(rewards.values())})


# -- the comparison ----------------------------------------------------------------------------------


def combined(results: list[Result], what: str) -> float:
    """Throughput of runs that share the machine: their steps 2..N over the span from the earliest
    first step's end to the latest last step's end (perf_counter is one monotonic clock per host)."""
    per_step = [r.samples if what == "samples" else r.tokens for r in results]
    span = max(r.ends[-1] for r in results) - min(r.ends[0] for r in results)
    return sum(sum(s[1:]) for s in per_step) / span


def sequential(results: list[Result], what: str) -> float:
    """Throughput of runs made one after the other: their work over the sum of their spans."""
    per_step = [r.samples if what == "samples" else r.tokens for r in results]
    return sum(sum(s[1:]) for s in per_step) / sum(r.ends[-1] - r.ends[0] for r in results)


def cpu_ms_per_sample(results: list[Result]) -> float:
    """CPU-milliseconds per sample over steps 2..N: what a side costs the machine, whatever the
    overlap. TRL ÷ polyrl bounds the throughput ratio when both keep every core busy."""
    return 1000 * sum(r.cpu_s for r in results) / max(sum(r.work() for r in results), 1)


@dataclass(frozen=True)
class Row:
    case: str
    goal: float  # polyrl / TRL throughput (samples and tokens)
    polyrl: tuple[float, float, float]  # samples/s, tokens/s, reward
    trl: tuple[float, float, float]
    startup: tuple[float, float]
    cpu: tuple[float, float]  # CPU-ms per sample, polyrl and TRL
    busy: tuple[float, float]  # cores kept busy on average: CPU-seconds over wall seconds
    cpu_goal: float | None = None  # polyrl's CPU-ms per sample at most this times TRL's

    def ratios(self) -> tuple[float, float]:
        return self.polyrl[0] / self.trl[0], self.polyrl[1] / self.trl[1]

    def met(self) -> bool:
        cpu_ok = self.cpu_goal is None or self.cpu[0] <= self.cpu_goal * self.cpu[1]
        return min(self.ratios()) >= self.goal and self.polyrl[2] >= self.trl[2] and cpu_ok


def compare(h: Hyper, model_dir: Path, data_path: Path, mode: str, tail: int, *, pool: bool) -> list[Row]:
    cores = len(os.sched_getaffinity(0))
    goals = POOLED_GOALS if pool else GOALS
    one = polyrl_run(h, model_dir, data_path, ["agent"], mode, pool=pool)["agent"]
    alone = {t: trl_processes(h, model_dir, data_path, t, 1)[0] for t in sorted({1, cores})}
    threads = max(alone, key=lambda t: alone[t].rate("samples"))
    best = alone[threads]
    two = list(polyrl_run(h, model_dir, data_path, ["a", "b"], mode, pool=pool).values())
    # One after the other: the faster single run and a second run with its thread count.
    after = [best, trl_processes(h, model_dir, data_path, threads, 1)[0]]
    beside = trl_processes(h, model_dir, data_path, max(1, cores // 2), 2)

    def reward(rs: list[Result]) -> float:
        return statistics.fmean(r.reward(tail) for r in rs)

    def figures(rs: list[Result], rate: Any) -> tuple[float, float, float]:
        return rate(rs, "samples"), rate(rs, "tokens"), reward(rs)

    def cost(p: list[Result], t: list[Result], rate_t: Any) -> dict[str, tuple[float, float]]:
        """CPU per sample of each side and the cores each kept busy (samples/s x CPU-s per sample)."""
        cp, ct = cpu_ms_per_sample(p), cpu_ms_per_sample(t)
        return {
            "cpu": (cp, ct),
            "busy": (combined(p, "samples") * cp / 1000, rate_t(t, "samples") * ct / 1000),
        }

    for case, r in (("one policy", one), ("two policies", two[0])):
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r.cpu_ms_by_role.items())
        print(f"polyrl CPU-ms per sample by process, {case}: {parts}")
    print(
        "TRL alone, samples/s by torch threads: "
        + ", ".join(f"{t}: {r.rate('samples'):.1f}" for t, r in alone.items())
        + f"; one after the other with {threads}, side by side with {max(1, cores // 2)} each"
    )
    return [
        Row(
            "one policy",
            goals["one policy"],
            figures([one], combined),
            figures([best], combined),
            (one.startup_s, best.startup_s),
            **cost([one], [best], combined),
            cpu_goal=POOLED_CPU_GOAL if pool else None,
        ),
        Row(
            "two policies, one after the other",
            goals["two policies, one after the other"],
            figures(two, combined),
            figures(after, sequential),
            (two[0].startup_s, after[0].startup_s),
            **cost(two, after, sequential),
        ),
        Row(
            "two policies, side by side",
            goals["two policies, side by side"],
            figures(two, combined),
            figures(beside, combined),
            (two[0].startup_s, max(r.startup_s for r in beside)),
            **cost(two, beside, combined),
        ),
    ]


def table(rows: list[Row]) -> str:
    head = (
        "| case | polyrl samples/s | TRL samples/s | ratio | polyrl tokens/s | TRL tokens/s | ratio "
        "| polyrl reward | TRL reward | goal | met |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        s, t = r.ratios()
        cpu = "" if r.cpu_goal is None else f", CPU <= {r.cpu_goal}x TRL's"
        lines.append(
            f"| {r.case} | {r.polyrl[0]:.1f} | {r.trl[0]:.1f} | {s:.2f}x | {r.polyrl[1]:.0f} | {r.trl[1]:.0f} "
            f"| {t:.2f}x | {r.polyrl[2]:.3f} | {r.trl[2]:.3f} | {r.goal}x{cpu}, reward >= TRL "
            f"| {'met' if r.met() else 'not met'} |"
        )
    lines += [
        "",
        "| case | polyrl CPU-ms/sample | TRL CPU-ms/sample | TRL / polyrl | polyrl busy cores "
        "| TRL busy cores |\n|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.case} | {r.cpu[0]:.2f} | {r.cpu[1]:.2f} | {r.cpu[1] / r.cpu[0]:.2f}x "
            f"| {r.busy[0]:.2f} | {r.busy[1]:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=Hyper.steps)
    ap.add_argument("--prompts", type=int, default=Hyper.prompts, help="rows per step")
    ap.add_argument("--group", type=int, default=Hyper.group)
    ap.add_argument("--lr", type=float, default=Hyper.lr)
    ap.add_argument("--max-new-tokens", type=int, default=Hyper.max_new_tokens)
    ap.add_argument("--temperature", type=float, default=Hyper.temperature)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--tail", type=int, default=5, help="steps whose mean reward is compared")
    ap.add_argument("--mode", choices=("async", "sync"), default="async", help="polyrl's mode")
    ap.add_argument("--pool", action="store_true", help="polyrl's policies colocated on one device pool")
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trl_worker:
        spec = json.loads(args.trl_worker)
        res = trl_run(Hyper(**spec["hyper"]), Path(spec["model"]), Path(spec["data"]), spec["threads"])
        print(json.dumps(asdict(res)))
        return
    if args.tail > args.steps - 1:
        ap.error(f"--tail {args.tail} must be below --steps {args.steps}")
    from _jobs import start_ray, stop_ray

    from polyrl_runtime.models.tiny_qwen2 import create_tiny_qwen2

    # Workflow workers import `vs_trl:PairedCompletion`: Ray's processes inherit this path.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    layout = "one device pool" if args.pool else "pods of their own"
    print(f"# {cores} cores, load average {load:.1f} at start, polyrl mode {args.mode}, roles on {layout}")
    start_ray()
    try:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            h = Hyper(
                args.steps, args.prompts, args.group, args.lr, args.max_new_tokens, args.temperature, seed
            )
            print(f"\n## seed {seed}: {h}")
            with tempfile.TemporaryDirectory() as tmp:
                model_dir = create_tiny_qwen2(Path(tmp) / "model")
                data_path = write_rows(Path(tmp) / "train.jsonl", rows(2 * h.steps * h.prompts, seed))
                out = compare(h, model_dir, data_path, args.mode, args.tail, pool=args.pool)
            print(table(out))
            print(
                "start-up s (polyrl / TRL): "
                + ", ".join(f"{r.case} {r.startup[0]:.1f} / {r.startup[1]:.1f}" for r in out)
            )
    finally:
        stop_ray()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
