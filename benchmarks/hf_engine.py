"""Tokens/s of the torch engine serving a Hugging Face model against transformers' `model.generate`.

    .venv/bin/python benchmarks/hf_engine.py [--quick] [--rounds 5] [--batch 16] [--prompt 32]
                                             [--tokens 64] [--tail-requests 48] [--tail-long 160]

The model is the tiny Qwen2 (`polyrl_runtime.models.tiny_qwen2`), float32 on CPU, greedy decoding,
the same prompts for both in the same run; runs alternate (generate, engine, generate, engine, ...)
so both see the same machine load, and each ratio is taken within a round (median and range over
the rounds). Two ratios, both engine over `model.generate` (above 1: the engine is faster):

- wall: tokens per second of wall time;
- CPU time: tokens per CPU-second of this process (all its threads). The figure the engine is
  judged by: on a shared host the wall time also counts waiting for a core, which neither side
  controls.

After setup the garbage collector's heap is frozen (`gc.freeze`): a full collection over the
imported libraries' objects takes about 0.1 s and would land in whichever run it happens to hit.

- equal: `--batch` requests of `--tokens` new tokens each, all at once: `model.generate` gets them as
  one batch; the engine gets them as concurrent requests (at most `--batch` running).
- long tail: `--tail-requests` requests, most of 8 new tokens and one in eight of `--tail-long`:
  `model.generate` runs them in batches of `--batch` in arrival order (each batch lasts as long as its
  longest reply; a batch cannot take new requests), the engine with continuous batching at most
  `--batch` at a time. Only the requested tokens count for either.

EOS is disabled on both sides so that every request generates exactly its number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import transformers

from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.models.tiny_qwen2 import create_tiny_qwen2

Request = tuple[list[int], int]  # prompt ids, new tokens


def timed(run: Callable[[], None]) -> tuple[float, float]:
    """Wall and CPU seconds of `run` (CPU time of this process: on a shared host the wall time
    also counts waiting for a core)."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def hf_generate(model: Any, requests: Sequence[Request], batch: int) -> None:
    """`model.generate` serves `requests`, `batch` at a time (left-padded)."""
    for i in range(0, len(requests), batch):
        chunk = requests[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        n = max(t for _, t in chunk)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
            )


def engine_generate(engine: TorchEngine, requests: Sequence[Request]) -> None:
    """The engine serves `requests`, all submitted at once."""

    async def go() -> None:
        gens = await asyncio.gather(
            *(engine.generate(p, SamplingParams(temperature=0, max_new_tokens=n)) for p, n in requests)
        )
        assert [len(g.token_ids) for g in gens] == [n for _, n in requests]

    asyncio.run(go())


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (length,), generator=gen).tolist() for _ in range(count)]


def compare(
    name: str, model: Any, engine: TorchEngine, requests: list[Request], *, batch: int, rounds: int
) -> float:
    """Print the case's row; returns the median CPU-time ratio."""
    tokens = sum(n for _, n in requests)
    hf_generate(model, requests[:batch], batch)  # warm-up of both paths
    engine_generate(engine, requests[:batch])
    hf_tps, eng_tps, ratios, cpu_ratios = [], [], [], []
    for _ in range(rounds):
        hf_wall, hf_cpu = timed(lambda: hf_generate(model, requests, batch))
        eng_wall, eng_cpu = timed(lambda: engine_generate(engine, requests))
        hf_tps.append(tokens / hf_wall)
        eng_tps.append(tokens / eng_wall)
        ratios.append(hf_wall / eng_wall)
        cpu_ratios.append(hf_cpu / eng_cpu)
    cpu = statistics.median(cpu_ratios)
    print(
        f"| {name} | {len(requests)} | {tokens} | {statistics.median(hf_tps):.0f} | "
        f"{statistics.median(eng_tps):.0f} | {statistics.median(ratios):.2f}x | "
        f"{min(ratios):.2f}x-{max(ratios):.2f}x | {cpu:.2f}x | "
        f"{min(cpu_ratios):.2f}x-{max(cpu_ratios):.2f}x |"
    )
    return cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer and shorter requests, one round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--tail-requests", type=int, default=48)
    ap.add_argument("--tail-long", type=int, default=160)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.tokens, args.tail_requests, args.tail_long = 1, 16, 16, 32
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = create_tiny_qwen2(Path(tmp) / "tiny-qwen2")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        engine = TorchEngine("bench", "bench", f"file://{path}", dtype="float32", max_batch=args.batch)
        equal = [(p, args.tokens) for p in prompts(args.batch, args.prompt, 0)]
        tail = [
            (p, args.tail_long if i % 8 == 0 else 8)
            for i, p in enumerate(prompts(args.tail_requests, args.prompt, 1))
        ]
        gc.collect()
        gc.freeze()
        print("tokens/s, tiny Qwen2 (float32, CPU, one thread), greedy; ratios = engine / model.generate")
        print(
            "| case | requests | tokens | model.generate tok/s | engine tok/s | wall ratio | wall range "
            "| CPU-time ratio | CPU-time range |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        cpu = compare(
            f"equal (batch {args.batch})", model, engine, equal, batch=args.batch, rounds=args.rounds
        )
        compare(f"long tail (batch {args.batch})", model, engine, tail, batch=args.batch, rounds=args.rounds)
        print(
            f"\njudged by the CPU-time ratio at equal lengths (goal >= 1.0x): {cpu:.2f}x"
            f"\ncpus={os.cpu_count()} rounds={args.rounds} prompt={args.prompt} transformers={transformers.__version__}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
