"""Chunked log-probabilities: the naive full-vocabulary numbers, at a fraction of the memory.

The reference below is the direct computation (every position's float32 logits over the whole
vocabulary at once). Values and gradients must match it for Hugging Face models (peft-wrapped too)
and the built-in model; peak memory is measured as the process's peak resident set (reset through
/proc/self/clear_refs) at Qwen's 151,936-token vocabulary.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from polyrl_runtime.algorithms.losses import TokenBatch, sequence_logprobs, sequence_logprobs_and_entropy
from polyrl_runtime.models.tiny import build_tiny


def naive(model: torch.nn.Module, tb: TokenBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, R] logprobs and entropies from the full [B, R, V] float32 log-softmax."""
    out = model(tb.input_ids, attention_mask=tb.attention_mask)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    idx = tb.gather_index[..., None].expand(-1, -1, logits.shape[-1])
    scaled = logits.gather(1, idx).float() / temperature
    for i, a in enumerate(tb.allowed):
        if len(a):
            keep = torch.zeros(scaled.shape[-1], dtype=torch.bool)
            keep[torch.from_numpy(a.astype(np.int64))] = True
            scaled[i] = scaled[i].masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(scaled, dim=-1)
    finite = torch.isfinite(logp)
    safe = torch.where(finite, logp, torch.zeros_like(logp))
    entropy = -torch.where(finite, safe.exp() * safe, torch.zeros_like(safe)).sum(-1)
    picked = logp.gather(2, tb.targets[..., None])[..., 0]
    real = tb.response_mask > 0
    return torch.where(real, picked, 0.0), torch.where(real, entropy, 0.0)


def _batch(
    vocab: int, rows: list[tuple[int, int]], allowed: dict[int, list[int]], seed: int = 0
) -> TokenBatch:
    rng = np.random.default_rng(seed)
    prompts, responses, allow = [], [], []
    for i, (p, r) in enumerate(rows):
        ids = allowed.get(i)
        prompts.append(rng.integers(1, vocab, p).astype(np.int32))
        responses.append((rng.choice(ids, r) if ids else rng.integers(1, vocab, r)).astype(np.int32))
        allow.append(np.array(ids or [], dtype=np.int32))
    return TokenBatch.build(prompts, responses, allow)


def _qwen2(vocab: int, hidden: int = 32) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg)


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_matches_naive(model: torch.nn.Module, tb: TokenBatch, temperature: float) -> None:
    ref_lp, ref_ent = naive(model, tb, temperature)
    lp, ent = sequence_logprobs_and_entropy(model, tb, temperature, chunk_tokens=3)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sequence_logprobs(model, tb, temperature, chunk_tokens=5), ref_lp)
    # The gradients of a loss that uses both, through the checkpointed chunks.
    weights = torch.linspace(-1.0, 1.0, lp.numel()).view_as(lp)
    want = _grads(model, (ref_lp * weights).sum() + 0.1 * ref_ent.sum())
    lp, ent = sequence_logprobs_and_entropy(model, tb, temperature, chunk_tokens=3)
    got = _grads(model, (lp * weights).sum() + 0.1 * ent.sum())
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_hugging_face_model_matches_the_full_vocabulary_computation(tiny_qwen2_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    tb = _batch(vocab, [(4, 7), (6, 2), (3, 5)], allowed={1: [5, 9, 17, 40]})
    _assert_matches_naive(model, tb, temperature=0.7)


def test_peft_wrapped_model_scores_through_its_adapters(tiny_qwen2_dir: Path) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():  # non-zero adapters, so they change the output
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    tb = _batch(model.config.vocab_size, [(5, 6), (3, 4)], allowed={0: [3, 4, 8]})
    _assert_matches_naive(model, tb, temperature=1.0)
    with torch.no_grad():
        adapted = sequence_logprobs(model, tb)
        with model.disable_adapter():
            plain = sequence_logprobs(model, tb)
    assert not torch.allclose(adapted, plain)  # the adapters are in the scored path
    lora = _grads(model, sequence_logprobs(model, tb).sum())
    assert any("lora_" in n for n in lora)


def test_built_in_model_matches_the_full_vocabulary_computation() -> None:
    model = build_tiny("tiny", vocab_size=64, seed=3)
    tb = _batch(64, [(3, 4), (2, 1), (5, 3)], allowed={0: [1, 2, 3], 2: [7, 8]})
    _assert_matches_naive(model, tb, temperature=0.5)


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _peak_rss_bytes(fn: Callable[[], object]) -> int:
    """Peak resident set reached while `fn` runs, above the resident set before it.

    glibc serves blocks below its (adaptive) mmap threshold from heaps it may keep after a free,
    which would make the figure depend on what ran before. A fixed 64 KiB threshold maps every
    tensor-sized block and unmaps it on free, so the resident set tracks the live tensors."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)
    try:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
        before = _status_kib("VmRSS")
        fn()
        return (_status_kib("VmHWM") - before) * 1024
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 128 << 10)  # glibc's default


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_peak_memory_is_a_tenth_of_the_naive_loss_at_qwen_vocabulary() -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak resident set")
    vocab = 151_936
    model = _qwen2(vocab)
    tb = _batch(vocab, [(8, 40), (4, 30), (16, 30)], allowed={2: list(range(100, 5000))})
    for p in model.parameters():  # gradients allocated up front: both runs then hold the same state
        p.grad = torch.zeros_like(p)
    results: dict[str, torch.Tensor] = {}

    def loss_and_backward(name: str, score: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        lp, ent = score()
        (lp.sum() + 0.01 * ent.sum()).backward()
        results[name] = torch.stack([lp.detach(), ent.detach()])

    chunked = _peak_rss_bytes(
        lambda: loss_and_backward("chunked", lambda: sequence_logprobs_and_entropy(model, tb, chunk_tokens=4))
    )
    full = _peak_rss_bytes(lambda: loss_and_backward("naive", lambda: naive(model, tb, 1.0)))
    positions = int(tb.response_mask.sum())
    assert full > positions * vocab * 4  # at least one float32 [positions, V] tensor
    assert chunked <= 0.1 * full, (chunked, full)
    torch.testing.assert_close(results["chunked"], results["naive"], rtol=1e-5, atol=1e-5)
