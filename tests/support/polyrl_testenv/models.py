"""Test models derived from the built-in tiny Qwen2, and a way to drive the torch engine in tests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
import transformers


def lively_qwen2(source: Path, out: Path, seed: int, std: float = 0.15) -> Path:
    """A copy of the model directory `source` (tokenizer included) with its matrices redrawn at `std`:
    freshly initialised (std 0.02) its next-token distributions are nearly uniform, so greedy replies
    barely vary and two computations of a log-probability could differ unseen."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std, generator=gen)
    model.save_pretrained(str(out))
    transformers.AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(out))
    return out


def moved_model(model_dir: Path, version: int, std: float = 0.1) -> Any:
    """The Hugging Face model at `model_dir` with every matrix moved by a draw of seed `version` (a
    stand-in for that version's trained weights), float32, in eval mode."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * std)
    model.train(False)
    return model


async def publish_full(engine: Any, model: Any, version: int, policy: str) -> None:
    """`model`'s parameters as `policy`'s version `version`, received by `engine` through shm."""
    from polyrl_runtime.weights import make_sender

    sender = make_sender("shm", policy, 1 << 20)
    try:
        tensors = {k: p.detach().clone() for k, p in model.named_parameters()}
        assert (await engine.receive_weights(sender.publish(version, tensors))).applied
    finally:
        sender.close()


def greedy_reply(model: Any, prompt: list[int] | tuple[int, ...], n: int) -> list[int]:
    """The `n` tokens transformers' `generate` picks greedily after `prompt` (no end id)."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


async def join_midway(engine: Any, requests: list[tuple[list[int], Any]]) -> list[Any]:
    """Generate `requests` (prompt ids, sampling params) on a torch engine: the first half starts; the
    rest join once the first running request has 3 tokens, so rows of several lengths share decoding
    steps (left padding, cache rows added and dropped)."""
    half = len(requests) // 2
    first = [asyncio.create_task(engine.generate(p, s)) for p, s in requests[:half]]
    while not engine._active or len(engine._active[0].tokens) < 3:
        await asyncio.sleep(0.001)
    rest = [engine.generate(p, s) for p, s in requests[half:]]
    return list(await asyncio.gather(*first, *rest))
