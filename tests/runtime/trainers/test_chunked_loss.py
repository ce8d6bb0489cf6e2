"""The chunked loss through a DeepSpeed engine: the gradients of the full-vocabulary loss.

`sequence_logprobs_and_entropy(engine, ...)` calls the engine's forward (its backward prologue is
registered there), then the output head chunk by chunk with recomputation in backward. Under ZeRO-0
and ZeRO-3 (the head and embeddings partitioned, gathered by DeepSpeed's hooks per chunk and again in
the recomputation) the gradients equal those of the naive full-vocabulary log-softmax of the
logits under ZeRO-0, and under ZeRO-3 a step trains every part of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.algorithms.losses import TokenBatch, sequence_logprobs_and_entropy
from polyrl_runtime.trainers.build import build_trainer
from polyrl_runtime.trainers.export import zero_gather
from polyrl_runtime.trainers.publish import published_tensors

CPU = torch.device("cpu")
Score = Callable[[torch.nn.Module, TokenBatch], torch.Tensor]


def _batch() -> TokenBatch:
    rng = np.random.default_rng(0)
    rows = [(5, 9), (3, 4), (7, 6)]
    return TokenBatch.build(
        [rng.integers(1, 300, p).astype(np.int32) for p, _ in rows],
        [rng.integers(1, 300, r).astype(np.int32) for _, r in rows],
        [np.zeros(0, dtype=np.int32)] * len(rows),
    )


def _chunked(engine: torch.nn.Module, tb: TokenBatch) -> torch.Tensor:
    lp, ent = sequence_logprobs_and_entropy(engine, tb, 0.8, chunk_tokens=4)
    return lp.sum() + 0.1 * ent.sum()


def _naive(engine: torch.nn.Module, tb: TokenBatch) -> torch.Tensor:
    logits = engine(tb.input_ids, attention_mask=tb.attention_mask).logits
    picked = logits.gather(1, tb.gather_index[..., None].expand(-1, -1, logits.shape[-1])).float() / 0.8
    logp = torch.log_softmax(picked, dim=-1)
    lp = logp.gather(2, tb.targets[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    real = tb.response_mask > 0
    return torch.where(real, lp, 0.0).sum() + 0.1 * torch.where(real, ent, 0.0).sum()


def _gradients(policy: Policy, score: Score) -> dict[str, torch.Tensor]:
    """Full gradients of every parameter after one backward through the engine."""
    from deepspeed.utils import safe_get_full_grad

    built = build_trainer(policy, seed=1, cuda=False, device=CPU, total_steps=2)
    built.engine.backward(-score(built.engine, _batch()))
    grads = {n: safe_get_full_grad(p) for n, p in built.engine.module.named_parameters()}
    assert all(g is not None for g in grads.values())
    # Copies before the step: under ZeRO-0 these are the live .grad tensors, which clipping scales.
    return {n: g.clone() for n, g in grads.items() if g is not None}


@pytest.mark.parametrize("stage", [0, 3])
def test_chunked_loss_has_the_gradients_of_the_full_vocabulary_loss(
    gloo: None, hf_policy: Callable[[Path, int], Policy], tiny_qwen2_dir: Path, stage: int
) -> None:
    want = _gradients(hf_policy(tiny_qwen2_dir, 0), _naive)
    got = _gradients(hf_policy(tiny_qwen2_dir, stage), _chunked)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_zero3_engine_scores_like_the_full_vocabulary_and_trains(
    gloo: None, hf_policy: Callable[[Path, int], Policy], tiny_qwen2_dir: Path
) -> None:
    built = build_trainer(hf_policy(tiny_qwen2_dir, 3), seed=1, cuda=False, device=CPU, total_steps=2)
    assert all(p.numel() == 0 for p in built.engine.module.get_output_embeddings().parameters())
    tb = _batch()
    with torch.no_grad():
        torch.testing.assert_close(_chunked(built.engine, tb), _naive(built.engine, tb))
    before = {n: t.clone() for n, t in published_tensors(built.engine.module, zero_gather(3)).items()}
    built.engine.backward(-_chunked(built.engine, tb))
    built.engine.step()
    after = published_tensors(built.engine.module, zero_gather(3))
    assert all(
        not torch.equal(after[n], before[n]) for n in ("lm_head.weight", "model.norm.weight") if n in before
    )
    assert not torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
