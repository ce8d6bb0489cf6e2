"""Memory of the chunked loss and trainer throughput with and without gradient checkpointing.

    .venv/bin/python benchmarks/hf_trainer.py [--quick] [--positions 256] [--chunk 16]
                                              [--rounds 5] [--rows 8] [--tokens 96] [--steps 20]

1. Peak memory of the loss (forward + backward of response logprobs and entropy) at Qwen's
   151,936-token vocabulary, `sequence_logprobs_and_entropy` in chunks of `--chunk` positions against
   the naive computation (one float32 [positions, vocab] log-softmax), on a one-layer Qwen2 of hidden
   32 so that the vocabulary dominates. Memory is the process's peak resident set above the one
   before (Linux VmHWM, reset through /proc/self/clear_refs), with glibc's mmap threshold fixed at
   64 KiB so every tensor-sized block is returned to the system when freed. Goal: ratio <= 0.1.
2. Trainer tokens/s on the tiny Qwen2 (float32, CPU, DeepSpeed ZeRO-0 over gloo, world 1): one
   optimizer step per iteration on `--rows` rows of `--tokens` tokens, with and without gradient
   checkpointing, alternating in each round so both see the same machine load; the ratio
   (with / without) is taken per round (median, min, max).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from polyrl_operator.api import Policy
from polyrl_runtime.algorithms.losses import TokenBatch, sequence_logprobs_and_entropy

QWEN_VOCAB = 151_936
M_MMAP_THRESHOLD = -3


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_rss_bytes(fn: Callable[[], object]) -> int:
    """Peak resident set while `fn` runs, above the resident set before it."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)
    try:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
        fn()
        return (_status_kib("VmHWM") - before) * 1024
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 128 << 10)


def _batch(vocab: int, rows: int, prompt: int, response: int, seed: int = 0) -> TokenBatch:
    rng = np.random.default_rng(seed)
    return TokenBatch.build(
        [rng.integers(1, vocab, prompt).astype(np.int32) for _ in range(rows)],
        [rng.integers(1, vocab, response).astype(np.int32) for _ in range(rows)],
        [np.zeros(0, dtype=np.int32)] * rows,
    )


def naive(model: torch.nn.Module, tb: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The full [B, R, V] float32 log-softmax (what the loss did before chunking)."""
    logits = model(tb.input_ids, attention_mask=tb.attention_mask).logits
    picked = logits.gather(1, tb.gather_index[..., None].expand(-1, -1, logits.shape[-1])).float()
    logp = torch.log_softmax(picked, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    real = tb.response_mask > 0
    return torch.where(real, logp.gather(2, tb.targets[..., None])[..., 0], 0.0), torch.where(
        real, entropy, 0.0
    )


def loss_memory(positions: int, chunk: int) -> tuple[int, int]:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=QWEN_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg)
    rows = max(1, positions // 64)
    tb = _batch(QWEN_VOCAB, rows, 8, positions // rows)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def run(score: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        lp, ent = score()
        (lp.sum() + 0.01 * ent.sum()).backward()

    run(lambda: sequence_logprobs_and_entropy(model, tb, chunk_tokens=chunk))  # one-time allocations
    chunked = peak_rss_bytes(
        lambda: run(lambda: sequence_logprobs_and_entropy(model, tb, chunk_tokens=chunk))
    )
    full = peak_rss_bytes(lambda: run(lambda: naive(model, tb)))
    return chunked, full


def _gloo() -> None:
    from polyrl_runtime.netmap import free_port
    from polyrl_runtime.trainers.deepspeed_import import import_deepspeed

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    import_deepspeed().init_distributed(dist_backend="gloo")


def trainer_throughput(
    model_dir: Path, rounds: int, rows: int, tokens: int, steps: int
) -> list[tuple[float, float]]:
    """[(tokens/s without, tokens/s with gradient checkpointing)] per round."""
    from polyrl_runtime.trainers.build import build_trainer

    def policy(checkpointing: bool) -> Policy:
        return Policy.model_validate(
            {
                "name": "agent",
                "model": {"uri": f"file://{model_dir}", "dtype": "float32"},
                "algorithm": {"lr": 1e-4},
                "rollout": {"engine": "torch", "gpus": 0},
                "trainer": {"gpus": 0, "zeroStage": 0, "gradientCheckpointing": checkpointing},
            }
        )

    engines = {
        c: build_trainer(policy(c), seed=1, cuda=False, device=torch.device("cpu"), total_steps=10_000).engine
        for c in (False, True)
    }
    tb = _batch(320, rows, tokens // 4, tokens - tokens // 4)
    trained = int(tb.response_mask.sum())

    def rate(engine: torch.nn.Module) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            lp, ent = sequence_logprobs_and_entropy(engine, tb)
            engine.backward(-(lp.sum() + 0.01 * ent.sum()))  # type: ignore[operator]
            engine.step()  # type: ignore[operator]
        return trained * steps / (time.perf_counter() - start)

    rate(engines[False])  # warm-up
    rate(engines[True])
    return [(rate(engines[False]), rate(engines[True])) for _ in range(rounds)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (under a minute)")
    ap.add_argument("--positions", type=int, default=256, help="response tokens scored in the memory test")
    ap.add_argument("--chunk", type=int, default=16, help="positions per chunk")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96, help="tokens per row (a quarter prompt)")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per measurement")
    args = ap.parse_args(argv)
    if args.quick:
        args.positions, args.chunk, args.rounds, args.rows, args.tokens, args.steps = 128, 4, 1, 4, 48, 2

    if Path("/proc/self/clear_refs").exists():
        chunked, full = loss_memory(args.positions, args.chunk)
        print("loss peak memory at vocabulary 151936 (MiB): positions chunk chunked naive ratio")
        print(
            f"memory {args.positions} {args.chunk} {chunked / 2**20:.1f} {full / 2**20:.1f} {chunked / full:.3f}"
        )
    else:
        print("memory skipped: needs Linux /proc/self/clear_refs")

    from polyrl_runtime.models.tiny_qwen2 import create_tiny_qwen2

    _gloo()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny_qwen2(Path(tmp) / "tiny-qwen2")
        results = trainer_throughput(model_dir, args.rounds, args.rows, args.tokens, args.steps)
    ratios = [with_ / without for without, with_ in results]
    print("trainer tokens/s (tiny Qwen2, ZeRO-0, CPU): round without with ratio(with/without)")
    for i, (without, with_) in enumerate(results):
        print(f"throughput {i} {without:.1f} {with_:.1f} {with_ / without:.3f}")
    print(
        f"checkpointing ratio median {statistics.median(ratios):.3f} min {min(ratios):.3f} max {max(ratios):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
