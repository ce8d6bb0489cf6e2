"""Several policies as LoRA adapters on one torch engine, against one engine per policy.

    .venv/bin/python benchmarks/lora_sharing.py [--quick] [--scale 1] [--dtype bfloat16] [--rank 16]
                                                [--adapters 1,2,4,8] [--rounds 3] [--batch 16] [--tokens 32]
                                                [--trainer-adapters 4]

The base is a Qwen2 of Qwen2.5-0.5B's shape (24 layers, hidden 896, intermediate 4864, 14 heads / 2
KV heads, vocabulary 151,936, tied embeddings; `--scale N` divides hidden size, intermediate size and
vocabulary by N), built in code with random weights. Every adapter is rank `--rank`, alpha twice the
rank, on every linear layer (`all-linear`), with random A and B, loaded through the engine's own
adapter targets (`engines/adapters.py`). `--quick` uses the tiny Qwen2 and tiny sizes (the smoke test).

Tables:

- memory: the resident set (RSS) of one engine process holding the base and N adapters, each loaded
  with one version, after serving a batch that mixes them, against one engine of one policy's full
  weights (one process, same model, one batch served). N engines of full weights hold N such
  processes (N times the RSS of one). Goal: at 8 adapters <= 1.15x one engine.
- tokens/s: `--batch` greedy requests of `--tokens` new tokens, served three ways on one engine with 4
  adapters: all by one adapter; mixed, the requests spread over the 4 adapters in one batch (each
  row with its own adapter, `engines/lora_bank.py`); one batch per adapter, one after the other (an
  engine that cannot mix adapters). Ratios are taken within each round (rounds alternate the three);
  the table gives medians. Judged by CPU time of this process. Goal: mixed / one adapter >= 0.8.
  In float32 (this table and the next): bfloat16 matmuls on this CPU are several times slower.
- update: one adapter version moved through the shared-memory transport (`shm`) into the engine,
  against one full-weight version of the same model: the bytes moved (goal: the adapter's bytes plus
  at most 1%) and the time from publish to applied (best of `--rounds`).
- trainer memory: the RSS of one trainer process holding the base once and `--trainer-adapters`
  policies' adapters (trainers/adapter_engine.py), each with its AdamW state after one training step
  of its own (`--batch` rows of 16 tokens, a language-modelling loss, no gradient checkpointing),
  against that many trainers of one policy each (the same code with one adapter, one process each).
  Reported, with no goal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import psutil
import torch

from polyrl_operator.api import Lora
from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.models.tiny_qwen2 import SIZES, TinyQwen2Size, create_tiny_qwen2
from polyrl_runtime.weights import make_sender

QWEN25_05B = TinyQwen2Size(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151_936,
    max_position_embeddings=4096,
)
PROMPT = 16


def size_of(scale: int, quick: bool) -> TinyQwen2Size:
    if quick:
        return SIZES["tiny-qwen2"]
    s = QWEN25_05B
    return TinyQwen2Size(
        hidden_size=s.hidden_size // scale,
        intermediate_size=s.intermediate_size // scale,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads // scale if s.num_attention_heads % scale == 0 else 7,
        num_key_value_heads=1 if scale > 1 else s.num_key_value_heads,
        vocab_size=s.vocab_size // scale,
        max_position_embeddings=s.max_position_embeddings,
    )


def names(n: int) -> list[str]:
    return [f"policy-{i}" for i in range(n)]


def engine(path: Path, dtype: str, adapters: Sequence[str], rank: int, batch: int) -> TorchEngine:
    loras = {a: Lora(rank=rank, alpha=2 * rank, target_modules=["all-linear"]) for a in adapters}
    return TorchEngine(
        "bench",
        "bench",
        f"file://{path}",
        transport="shm",
        dtype=dtype,
        max_batch=batch,
        adapters=loras or None,
    )


def load_random(eng: TorchEngine, seed: int) -> None:
    """One version of every adapter, random A and B, applied through the adapter's own target."""
    assert eng.adapters is not None
    gen = torch.Generator().manual_seed(seed)
    for policy, target in eng.adapters.targets.items():
        with target.paused(1):
            for t in target.named_tensors().values():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
        assert eng.adapters.version(policy) == 1


def prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (PROMPT,), generator=gen).tolist() for _ in range(count)]


def serve(eng: TorchEngine, batches: Sequence[Sequence[tuple[list[int], str]]], tokens: int) -> None:
    """Each batch's requests at once (prompt, policy), the batches one after the other."""

    async def go() -> None:
        for batch in batches:
            gens = await asyncio.gather(
                *(
                    eng.generate(p, SamplingParams(temperature=0, max_new_tokens=tokens, policy=policy))
                    for p, policy in batch
                )
            )
            assert all(len(g.token_ids) == tokens for g in gens)

    asyncio.run(go())


def child_memory(args: argparse.Namespace) -> None:
    """One engine process: print its RSS in bytes after loading and serving (`--child N`; 0: full)."""
    torch.set_num_threads(1)
    adapters = names(args.child)
    eng = engine(Path(args.model), args.dtype, adapters, args.rank, args.batch)
    if adapters:
        load_random(eng, seed=0)
    requests = [
        (p, adapters[i % len(adapters)] if adapters else "") for i, p in enumerate(prompts(args.batch, 0))
    ]
    serve(eng, [requests], 4)
    print(json.dumps({"rss": psutil.Process().memory_info().rss}))


def child_trainer_memory(args: argparse.Namespace) -> None:
    """One trainer process of N policies' adapters on one base: print its RSS in bytes after each
    policy took one optimizer step (`--trainer-child N`)."""
    from polyrl_operator.api import Policy
    from polyrl_runtime.trainers.adapter_engine import AdapterEngine, SharedBase

    torch.set_num_threads(1)
    lora = {"rank": args.rank, "alpha": 2 * args.rank, "targetModules": ["all-linear"]}
    model = {"uri": f"file://{args.model}", "dtype": args.dtype}
    policies = [
        Policy.model_validate({"name": n, "model": model, "algorithm": {"lr": 1e-4, "lora": lora}})
        for n in names(args.trainer_child)
    ]
    shared = SharedBase.build(policies, seed=0, cuda=False, device=torch.device("cpu"))
    ids = torch.tensor(prompts(args.batch, 0))
    for p in policies:
        engine = AdapterEngine(shared, p)
        with shared.active(p.name):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    print(json.dumps({"rss": psutil.Process().memory_info().rss}))


def trainer_table(args: argparse.Namespace, model: Path) -> float:
    n = args.trainer_adapters
    one = measure_rss(args, model, 1, "--trainer-child")
    shared = measure_rss(args, model, n, "--trainer-child")
    print(f"\ntrainer memory: RSS after one step per policy; base {args.dtype}, adapters rank {args.rank}")
    print("| trainers | policies each | RSS each (MiB) | total (MiB) | ratio to one trainer per policy |")
    print("|---|---|---|---|---|")
    print(f"| {n} | 1 | {one / 2**20:.0f} | {n * one / 2**20:.0f} | 1.00x |")
    ratio = shared / (n * one)
    print(f"| 1 | {n} | {shared / 2**20:.0f} | {shared / 2**20:.0f} | {ratio:.2f}x |")
    return ratio


def measure_rss(args: argparse.Namespace, model: Path, n: int, child: str = "--child") -> int:
    cmd = [sys.executable, __file__, child, str(n), "--model", str(model), "--dtype", args.dtype]
    cmd += ["--rank", str(args.rank), "--batch", str(args.batch)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rss: int = json.loads(out.strip().splitlines()[-1])["rss"]
    return rss


def memory_table(args: argparse.Namespace, model: Path) -> float:
    full = measure_rss(args, model, 0)
    print(f"\nmemory: RSS of one engine process; base {args.dtype}, adapters rank {args.rank} all-linear")
    print(
        "| adapters | one engine of adapters (MiB) | ratio to one full engine | N full engines (MiB) | their ratio |"
    )
    print("|---|---|---|---|---|")
    ratio = 0.0
    for n in args.adapters:
        rss = measure_rss(args, model, n)
        ratio = rss / full
        print(f"| {n} | {rss / 2**20:.0f} | {ratio:.3f}x | {n * full / 2**20:.0f} | {n:.1f}x |")
    print(f"one full engine: {full / 2**20:.0f} MiB")
    return ratio


def timed_cpu(run: Callable[[], None]) -> float:
    cpu = time.process_time()
    run()
    return time.process_time() - cpu


def throughput_table(args: argparse.Namespace, eng: TorchEngine) -> float:
    policies = names(4)
    reqs = prompts(args.batch, 1)
    one = [[(p, policies[0]) for p in reqs]]
    mixed = [[(p, policies[i % 4]) for i, p in enumerate(reqs)]]
    per_adapter = [[(p, a) for i, p in enumerate(reqs) if i % 4 == k] for k, a in enumerate(policies)]
    tokens = args.batch * args.tokens
    serve(eng, mixed, 2)  # warm-up
    cpu: dict[str, list[float]] = {"one": [], "mixed": [], "per": []}
    for _ in range(args.rounds):
        cpu["one"].append(timed_cpu(lambda: serve(eng, one, args.tokens)))
        cpu["mixed"].append(timed_cpu(lambda: serve(eng, mixed, args.tokens)))
        cpu["per"].append(timed_cpu(lambda: serve(eng, per_adapter, args.tokens)))
    mixed_ratio = statistics.median(o / m for o, m in zip(cpu["one"], cpu["mixed"], strict=True))
    per_ratio = statistics.median(o / p for o, p in zip(cpu["one"], cpu["per"], strict=True))
    mixed_vs_per = statistics.median(p / m for p, m in zip(cpu["per"], cpu["mixed"], strict=True))
    print(
        f"\ntokens/s (CPU time, float32), {args.batch} greedy requests of {args.tokens} tokens, "
        "4 adapters resident"
    )
    print("| serving | tokens/CPU-s | ratio to one adapter |")
    print("|---|---|---|")
    print(f"| one adapter, one batch | {tokens / statistics.median(cpu['one']):.0f} | 1.00x |")
    print(
        f"| 4 adapters mixed in one batch | {tokens / statistics.median(cpu['mixed']):.0f} | {mixed_ratio:.2f}x |"
    )
    print(f"| 4 adapters, one batch each | {tokens / statistics.median(cpu['per']):.0f} | {per_ratio:.2f}x |")
    print(f"mixed / one batch per adapter: {mixed_vs_per:.2f}x")
    return mixed_ratio


def update_table(args: argparse.Namespace, eng: TorchEngine, full: TorchEngine) -> float:
    assert eng.adapters is not None
    policy = eng.adapters.policies[0]
    adapter = {k: v.clone() for k, v in eng.adapters.target(policy).named_tensors().items()}
    weights = {k: v.clone() for k, v in full.target.named_tensors().items()}
    element = next(iter(adapter.values())).element_size()
    adapter_bytes = eng.adapters.target(policy).layout.nbytes(element)

    def move(target_engine: TorchEngine, name: str, tensors: dict[str, torch.Tensor]) -> tuple[int, float]:
        sender = make_sender("shm", name, 64 << 20)
        best, nbytes = float("inf"), 0
        try:
            for version in range(2, args.rounds + 2):  # past the version `load_random` applied
                start = time.perf_counter()
                manifest = sender.publish(version, tensors)
                report = asyncio.run(target_engine.receive_weights(manifest))
                best = min(best, time.perf_counter() - start)
                assert report.applied
                nbytes = manifest.nbytes
        finally:
            sender.close()
        return nbytes, best

    moved, adapter_s = move(eng, policy, adapter)
    full_bytes, full_s = move(full, "bench", weights)
    overhead = moved / adapter_bytes - 1
    print("\nupdate (float32): one version through shm, publish to applied (best of the rounds)")
    print("| update | bytes moved | adapter bytes | overhead | time (ms) | time ratio to full |")
    print("|---|---|---|---|---|---|")
    print(
        f"| one adapter | {moved} | {adapter_bytes} | {overhead * 100:.2f}% | {adapter_s * 1e3:.1f} | "
        f"{adapter_s / full_s:.3f}x |"
    )
    print(f"| full weights | {full_bytes} | - | - | {full_s * 1e3:.1f} | 1.000x |")
    return overhead


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny Qwen2, tiny sizes, one round")
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--trainer-adapters", type=int, default=4)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trainer-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child_memory(args)
        return 0
    if args.trainer_child is not None:
        child_trainer_memory(args)
        return 0
    args.adapters = [int(n) for n in args.adapters.split(",")]
    if args.quick:
        args.rounds, args.batch, args.tokens, args.dtype, args.rank = 1, 4, 4, "float32", 4
    torch.set_num_threads(1)
    size = size_of(args.scale, args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        model = create_tiny_qwen2(Path(tmp) / "base", size=size)
        print(
            f"base: Qwen2, {size.num_hidden_layers} layers, hidden {size.hidden_size}, intermediate "
            f"{size.intermediate_size}, vocabulary {size.vocab_size}, {args.dtype} "
            f"(built in {time.perf_counter() - start:.0f} s); cpus={os.cpu_count()}"
        )
        memory = memory_table(args, model)
        # float32: this CPU's bfloat16 matmuls are several times slower and would be what is measured.
        eng = engine(model, "float32", names(4), args.rank, args.batch)
        load_random(eng, seed=1)
        mixed = throughput_table(args, eng)
        full = engine(model, "float32", [], args.rank, args.batch)
        overhead = update_table(args, eng, full)
        trainers = trainer_table(args, model)
    print(
        f"\ngoals: memory at {args.adapters[-1]} adapters {memory:.3f}x (<= 1.15x); "
        f"mixed tokens/s {mixed:.2f}x (>= 0.8); update overhead {overhead * 100:.2f}% (<= 1%); "
        f"trainer memory, {args.trainer_adapters} adapters on one base: {trainers:.2f}x {args.trainer_adapters} "
        "trainers (reported)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
