"""What serving a league's snapshots costs on a torch engine (`spec.policies[].league`), for a LoRA
policy and for a full-weight one.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/league.py [--model builtin://smollm2-135m-instruct]
        [--rank 16] [--snapshots 0,1,2,4,8] [--full 0,1,2,4] [--copies 1,2] [--batch 16]
        [--tokens 32] [--rounds 3]

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

Full weights (engines/full_snapshots.py), for each K of `--full` and each serving-copy count C of
`--copies` (`league.residentSnapshots`; the largest K only for C > 1): one engine of the model alone
holds K snapshots as host copies; per row the host bytes, the snapshot time (the copy of the weights
to host memory), the switch time (loading a snapshot into a serving copy, median over the switches
the mixed batches made), and the same two tokens/s figures, each divided by K = 0's current-only
figure of this table.
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


def _stop(engine: TorchEngine) -> None:
    """End the serving loops of an engine done with (its own and its serving copies')."""
    full = engine.full_snapshots
    for e in [engine, *(s.engine for s in full.slots)] if full is not None else [engine]:
        task = getattr(e, "_loop_task", None)
        if task is not None:
            task.cancel()


def _mixed(batch: int, k: int) -> list[int | None]:
    """A league's batch: every other request at the current version, the rest over K snapshots."""
    return [None if i % 2 == 0 or not k else (i // 2) % k for i in range(batch)]


async def _rates(
    engine: TorchEngine, mixed: list[int | None], tokens: int, rounds: int
) -> tuple[float, float]:
    """Median tokens/s of the batch all at the current version, and of `mixed`, over `rounds`."""
    current, both = [], []
    for _ in range(rounds):
        current.append(await _decode(engine, [None] * len(mixed), tokens))
        both.append(await _decode(engine, mixed, tokens))
    return statistics.median(current), statistics.median(both)


async def measure(
    uri: str, *, rank: int, counts: list[int], batch: int, tokens: int, rounds: int
) -> list[str]:
    engine = _engine(uri, rank)
    _randomise(engine)
    model_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    await _decode(engine, [None] * batch, 4)  # warm up
    _stop(engine)
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
        cur, mix = await _rates(engine, _mixed(batch, k), tokens, rounds)
        base = cur if base is None else base
        _stop(engine)
        nbytes = report.nbytes if k else 0
        snap = f"{statistics.median(times) * 1e3:.1f} ms" if times else "-"
        rows.append(
            f"| {k} | {nbytes / 2**20:.2f} MiB ({nbytes / model_bytes:.1%}) | {snap} | {cur:.0f} | "
            f"{cur / base:.2f}x | {mix:.0f} | {mix / base:.2f}x |"
        )
    return rows


async def _full_snapshots(engine: TorchEngine, k: int) -> list[float]:
    """Take K snapshots of the engine's full weights (versions 0..K-1); the time each took."""
    times = []
    for version in range(k):
        engine.target._version = version  # as a weight update sets it: one more version to hold
        t0 = time.perf_counter()
        await engine.snapshot(POLICY, k)
        times.append(time.perf_counter() - t0)
    return times


async def measure_full(
    uri: str, *, counts: list[int], copies: list[int], batch: int, tokens: int, rounds: int
) -> list[str]:
    rows, base = [], None
    cases = [(k, 1) for k in counts] + [(max(counts), c) for c in copies if c > 1 and c <= max(counts)]
    for k, c in cases:
        engine = TorchEngine("bench", POLICY, uri, transport="shm", seed=1, dtype="float32", max_batch=64,
                             snapshot_slots=c)  # fmt: skip
        await _decode(engine, [None] * batch, 4)  # warm up
        times = await _full_snapshots(engine, k)
        await _decode(engine, _mixed(batch, k), 4)  # warm up: the serving copies are made
        cur, mix = await _rates(engine, _mixed(batch, k), tokens, rounds)
        base = cur if base is None else base
        _stop(engine)
        full = engine.full_snapshots
        nbytes = full.host_nbytes() if full is not None else 0
        switches = full.switches if full is not None else 0
        snap = f"{statistics.median(times) * 1e3:.0f} ms" if times else "-"
        switch = f"{full.switch_s / switches * 1e3:.1f} ms ({switches})" if full and switches else "-"
        rows.append(
            f"| {k} | {c if k else '-'} | {nbytes / 2**20:.0f} MiB | {snap} | {switch} | {cur:.0f} | "
            f"{cur / base:.2f}x | {mix:.0f} | {mix / base:.2f}x |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin://smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--snapshots", default="0,1,2,4,8", help="comma list of K (the first is the baseline)")
    ap.add_argument("--full", default="0,1,2,4", help="comma list of K for full weights ('' skips them)")
    ap.add_argument("--copies", default="1,2", help="comma list of serving copies (residentSnapshots)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    counts = [int(k) for k in args.snapshots.split(",")]
    full = [int(k) for k in args.full.split(",") if k]
    copies = [int(c) for c in args.copies.split(",")]
    if min(full, default=0) < 0 or min(copies) < 1:
        ap.error("--full: K >= 0; --copies: C >= 1")
    if not counts or min(counts) < 0 or args.batch < 2 or args.tokens < 1 or args.rounds < 1:
        ap.error("--snapshots: K >= 0; --batch >= 2, --tokens >= 1, --rounds >= 1")
    uri = args.model if args.model.startswith(("builtin://", "file://")) else f"file://{args.model}"
    model_dir(uri)  # converted once (cached) before any timing
    print(
        f"# {len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.1f}; {uri}, LoRA rank "
        f"{args.rank} on every linear layer; batch {args.batch} x {args.tokens} new tokens, "
        f"median of {args.rounds} rounds"
    )
    lora, full_rows = asyncio.run(
        _both(uri, rank=args.rank, counts=counts, full=full, copies=copies, batch=args.batch,
              tokens=args.tokens, rounds=args.rounds)
    )  # fmt: skip
    print("| snapshots K | their bytes (of the model's) | snapshot | tok/s current only | ratio | "
          "tok/s half on snapshots | ratio |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|")
    print("\n".join(lora))
    if full_rows:
        print("\n# full weights: K snapshots as host copies, C serving copies")
        print("| snapshots K | serving copies C | host bytes | snapshot | switch (count) | tok/s current "
              "only | ratio | tok/s half on snapshots | ratio |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        print("\n".join(full_rows))


async def _both(
    uri: str, *, rank: int, counts: list[int], full: list[int], copies: list[int], batch: int, tokens: int,
    rounds: int,
) -> tuple[list[str], list[str]]:  # fmt: skip
    """Both tables, on one event loop (each engine's serving loop lives on it)."""
    lora = await measure(uri, rank=rank, counts=counts, batch=batch, tokens=tokens, rounds=rounds)
    if not full:
        return lora, []
    return lora, await measure_full(
        uri, counts=full, copies=copies, batch=batch, tokens=tokens, rounds=rounds
    )


if __name__ == "__main__":
    main()
