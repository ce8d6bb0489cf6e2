"""What serving a league's snapshots costs on a torch engine of LoRA adapters (`spec.policies[].league`).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/league.py [--model builtin://smollm2-135m-instruct]
        [--rank 16] [--snapshots 0,1,2,4,8] [--batch 16] [--tokens 32] [--rounds 3]

One engine (float32, CPU, greedy) holds the policy's adapter (all linear layers at `--rank`) and K
snapshots of it, for each K of `--snapshots`. Per K:

- bytes: what the K snapshots take on the engine (the bank's copies of the adapter), and their
  ratio to the model's own weights;
- snapshot s: the time `Engine.snapshot` takes (the copy between two forward passes, median over
  the snapshots taken);
- tokens/s, current only: `--batch` requests at the current version, decoding `--tokens` each;
- tokens/s, mixed: the same batch with half its requests spread over the K snapshots (what a
  league's episodes send: the player at the current version, its rival at a past one);
- ratios: each tokens/s divided by K = 0's current-only figure, measured in the same run (the
  adapters of one layer are one stacked matmul, so every snapshot held widens it for every row).

A full-weight policy has no snapshots (validation refuses a league without algorithm.lora): a
past version of full weights would be a second copy of the model on the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from polyrl_operator.api import Lora
from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.models import model_dir

POLICY = "player"


def _engine(uri: str, rank: int) -> TorchEngine:
    lora = Lora(rank=rank, alpha=2 * rank, target_modules=["all-linear"])
    return TorchEngine(
        "bench", POLICY, uri, transport="shm", seed=1, dtype="float32", max_batch=64, adapters={POLICY: lora}
    )


def _randomise(engine: TorchEngine) -> None:
    """Give the adapter non-zero weights (B starts at zero), so a snapshot is a real copy to serve."""
    assert engine.adapters is not None
    gen = torch.Generator().manual_seed(0)
    for layer in engine.adapters.bank._layers.values():
        with torch.no_grad():
            layer.a.copy_(torch.randn(layer.a.shape, generator=gen) * 0.02)
            layer.b.copy_(torch.randn(layer.b.shape, generator=gen) * 0.02)


async def _decode(engine: TorchEngine, snapshots: list[int | None], tokens: int) -> float:
    """Tokens per second of wall time for one batch, request i at `snapshots[i]` (None: current)."""
    prompts = [[1 + (7 * i + j) % 300 for j in range(16)] for i in range(len(snapshots))]
    start = time.perf_counter()
    await asyncio.gather(
        *(
            engine.generate(
                p, SamplingParams(temperature=0, max_new_tokens=tokens, policy=POLICY, snapshot=s)
            )
            for p, s in zip(prompts, snapshots, strict=True)
        )
    )
    return len(snapshots) * tokens / (time.perf_counter() - start)


async def measure(
    uri: str, *, rank: int, counts: list[int], batch: int, tokens: int, rounds: int
) -> list[str]:
    engine = _engine(uri, rank)
    _randomise(engine)
    model_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    await _decode(engine, [None] * batch, 4)  # warm up
    rows, base = [], None
    for k in counts:
        engine = _engine(uri, rank)
        _randomise(engine)
        assert engine.adapters is not None
        adapters = engine.adapters
        times = []
        for version in range(k):
            adapters.targets[POLICY]._version = version  # as a weight update sets it: one more to hold
            t0 = time.perf_counter()
            report = await engine.snapshot(POLICY, max(k, 1))
            times.append(time.perf_counter() - t0)
        held = list(range(k))
        mixed = [None if i % 2 == 0 or not held else held[(i // 2) % len(held)] for i in range(batch)]
        current, both = [], []
        for _ in range(rounds):
            current.append(await _decode(engine, [None] * batch, tokens))
            both.append(await _decode(engine, mixed, tokens))
        cur, mix = statistics.median(current), statistics.median(both)
        base = cur if base is None else base
        nbytes = report.nbytes if k else 0
        snap = f"{statistics.median(times) * 1e3:.1f} ms" if times else "-"
        rows.append(
            f"| {k} | {nbytes / 2**20:.2f} MiB ({nbytes / model_bytes:.1%}) | {snap} | {cur:.0f} | "
            f"{cur / base:.2f}x | {mix:.0f} | {mix / base:.2f}x |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin://smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--snapshots", default="0,1,2,4,8", help="comma list of K (the first is the baseline)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    counts = [int(k) for k in args.snapshots.split(",")]
    if not counts or min(counts) < 0 or args.batch < 2 or args.tokens < 1 or args.rounds < 1:
        ap.error("--snapshots: K >= 0; --batch >= 2, --tokens >= 1, --rounds >= 1")
    uri = args.model if args.model.startswith(("builtin://", "file://")) else f"file://{args.model}"
    model_dir(uri)  # converted once (cached) before any timing
    print(
        f"# {len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.1f}; {uri}, LoRA rank "
        f"{args.rank} on every linear layer; batch {args.batch} x {args.tokens} new tokens, "
        f"median of {args.rounds} rounds"
    )
    print("| snapshots K | their bytes (of the model's) | snapshot | tok/s current only | ratio | "
          "tok/s half on snapshots | ratio |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|")
    for row in asyncio.run(
        measure(uri, rank=args.rank, counts=counts, batch=args.batch, tokens=args.tokens, rounds=args.rounds)
    ):
        print(row)


if __name__ == "__main__":
    main()
