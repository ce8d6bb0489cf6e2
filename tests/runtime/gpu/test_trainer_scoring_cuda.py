"""The trainer's scoring and loss on CUDA, forward and backward, as the trainer runs them.

On CPU the chunked scoring is checked against the full-vocabulary computation
(algorithms/test_chunked_logprobs.py, trainers/test_chunked_loss.py). Here its CUDA path, with the
trainer's activation checkpointing on and the chunks checkpointed too: float32 on the GPU gives the
CPU's log-probabilities, entropies, loss and gradients (other kernels, other reduction orders: hence
tolerances, not equality); bfloat16 gives finite gradients pointing the float32 way; and at Qwen's
151,936-token vocabulary the CUDA allocator's peak stays a fraction of one float32
[positions, vocabulary] tensor, which the chunking exists to avoid.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.algorithms.losses import (
    LossConfig,
    TokenBatch,
    policy_loss,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)
from polyrl_runtime.models import load_model
from polyrl_runtime.trainers.build import enable_gradient_checkpointing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = "cuda"
VOCAB = 320  # builtin://tiny-qwen2's
ALLOWED = np.arange(40, 200, dtype=np.int32)
ADV = torch.tensor([1.0, -0.5, 0.3, -1.2])
CFG = LossConfig(kl_coef=0.1, entropy_coef=0.01)
TEMPERATURE = 0.8


def _batch() -> TokenBatch:
    """Four rows of several lengths: one constrained to `ALLOWED`, one with context tokens (not scored)."""
    rng = np.random.default_rng(0)
    rows = [(5, 30), (12, 20), (3, 40), (20, 8)]
    prompts = [rng.integers(1, VOCAB, p).astype(np.int32) for p, _ in rows]
    replies = [rng.integers(1, VOCAB, r).astype(np.int32) for _, r in rows]
    replies[1] = rng.choice(ALLOWED, rows[1][1]).astype(np.int32)
    allowed = [np.zeros(0, np.int32), ALLOWED, np.zeros(0, np.int32), np.zeros(0, np.int32)]
    masks = [np.ones(r, dtype=bool) for _, r in rows]
    masks[2][10:15] = False
    return TokenBatch.build(prompts, replies, allowed, masks)


def _policy(model_dir: Path, dtype: str) -> Policy:
    return Policy.model_validate(
        {
            "name": "agent",
            "model": {"uri": f"file://{model_dir}", "dtype": dtype},
            "algorithm": {"lr": 1e-2},
            "rollout": {"engine": "torch", "gpus": 1},
            "trainer": {"gpus": 1},
        }
    )


def _trainer_model(model_dir: Path, dtype: str, device: str) -> torch.nn.Module:
    """The policy's model as the trainer builds it: load_model, on its device, in training mode, with
    activation checkpointing."""
    policy = _policy(model_dir, dtype)
    model = load_model(policy.model.uri, dtype=dtype, cuda=device == "cuda").to(device)
    assert enable_gradient_checkpointing(model, policy)
    model.train()
    return model


def _step(
    model: torch.nn.Module, tb: TokenBatch, behav: torch.Tensor, chunk_tokens: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probabilities, entropies, loss and gradients of one micro-batch (GRPO: proximal = current)."""
    device = next(model.parameters()).device
    model.zero_grad()
    logp, entropy = sequence_logprobs_and_entropy(model, tb, TEMPERATURE, chunk_tokens=chunk_tokens)
    loss, _ = policy_loss(
        logp,
        logp.detach(),
        behav.to(device),
        ADV.to(device),
        tb.response_mask.to(device),
        cfg=CFG,
        ref_logp=logp.detach() - 0.05,
        entropy=entropy,
    )
    loss.backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach().cpu(), entropy.detach().cpu(), loss.detach().cpu(), grads


def _behaviour(model: torch.nn.Module, tb: TokenBatch) -> torch.Tensor:
    """Behaviour log-probabilities a little off the model's (importance weights around 1), on the CPU."""
    with torch.no_grad():
        logp = sequence_logprobs(model, tb, TEMPERATURE).cpu()
    noise = torch.from_numpy(np.random.default_rng(1).standard_normal(logp.shape).astype(np.float32))
    return logp - 0.1 * noise * tb.response_mask


def test_float32_scores_loss_and_gradients_on_cuda_match_the_cpu(varied_qwen2: Path) -> None:
    tb = _batch()
    cpu = _trainer_model(varied_qwen2, "float32", "cpu")
    behav = _behaviour(cpu, tb)
    want_lp, want_ent, want_loss, want_grads = _step(cpu, tb, behav, None)
    model = _trainer_model(varied_qwen2, "float32", GPU)
    # Several chunks per row, each checkpointed and recomputed in backward.
    for chunk_tokens in (16, None):
        lp, ent, loss, grads = _step(model, tb, behav, chunk_tokens)
        torch.testing.assert_close(lp, want_lp, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ent, want_ent, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-4)
        assert grads.keys() == want_grads.keys() and grads
        for name, g in grads.items():
            # Relative to the gradient's norm: CUDA sums an embedding's gradient rows in another
            # order (atomics), so single elements near zero differ by more than their own size.
            rel = float((g - want_grads[name]).norm() / want_grads[name].norm().clamp_min(1e-12))
            assert rel <= 1e-4, f"{name}: |cuda - cpu| / |cpu| = {rel:.2e} (chunk_tokens {chunk_tokens})"
    assert (lp[tb.response_mask == 0] == 0).all()  # padding and context tokens are not scored


def test_bfloat16_gradients_on_cuda_are_finite_and_follow_float32(
    varied_qwen2: Path, record_property: Callable[[str, object], None]
) -> None:
    tb = _batch()
    fp32 = _trainer_model(varied_qwen2, "float32", GPU)
    behav = _behaviour(fp32, tb)
    lp32, _, _, g32 = _step(fp32, tb, behav, None)
    model = _trainer_model(varied_qwen2, "bfloat16", GPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    lp16, ent16, loss16, g16 = _step(model, tb, behav, 16)
    assert lp16.dtype == torch.float32  # scored from float32 logits of the bfloat16 head
    assert torch.isfinite(lp16).all() and torch.isfinite(ent16).all() and torch.isfinite(loss16)
    assert g16.keys() == g32.keys() and g16
    cosines = {}
    for name, g in g16.items():
        assert torch.isfinite(g).all(), name
        assert g.abs().sum() > 0, name
        cosines[name] = float(torch.nn.functional.cosine_similarity(g.flatten(), g32[name].flatten(), dim=0))
    worst = min(cosines, key=cosines.__getitem__)
    record_property("max_abs_logprob_diff_vs_float32", float((lp16 - lp32).abs().max()))
    record_property("min_gradient_cosine_vs_float32", cosines[worst])
    # Weights rounded to bfloat16 move log-probabilities by up to about 0.2 here (CPU: 0.22, cosines
    # above 0.997): a cosine below 0.98 would be more than rounding.
    assert cosines[worst] >= 0.98, (worst, cosines[worst])


def test_chunked_scoring_peak_cuda_memory_at_qwen_vocabulary() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = 151_936
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg).to(GPU)
    rng = np.random.default_rng(0)
    rows, prompt, reply = 16, 16, 1024
    tb = TokenBatch.build(
        [rng.integers(1, vocab, prompt).astype(np.int32) for _ in range(rows)],
        [rng.integers(1, vocab, reply).astype(np.int32) for _ in range(rows)],
        [np.zeros(0, np.int32)] * rows,
    )
    for p in model.parameters():  # gradients allocated up front: the peak is the scoring's own
        p.grad = torch.zeros_like(p)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp, entropy = sequence_logprobs_and_entropy(model, tb)
    (logp.sum() + 0.01 * entropy.sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    full = rows * reply * vocab * 4  # one float32 [positions, vocabulary] tensor: about 10 GB
    assert torch.isfinite(logp).all() and torch.isfinite(model.model.embed_tokens.weight.grad).all()
    # One full float32 [positions, vocabulary] tensor would be `full`; a chunk's working set in
    # backward (logits, log-softmax, entropy terms and their gradients) is what remains.
    assert peak <= 0.2 * full, (peak, full)
