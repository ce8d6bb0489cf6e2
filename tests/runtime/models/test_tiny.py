"""The built-in model and tokenizer: left padding must not change a prompt's logits (the engine
batches prompts of different lengths), and the tokenizer round-trips its vocabulary."""

from __future__ import annotations

import pytest
import torch

from polyrl_runtime.models import CharTokenizer, load_model
from polyrl_runtime.models.tiny import build_tiny


def test_left_padding_gives_the_same_logits_as_alone() -> None:
    model = build_tiny("tiny", 64, seed=1).eval()
    a, b = [1, 10, 11, 12, 13, 14], [1, 20, 21]
    ids = torch.tensor([a, [0, 0, 0, *b]])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        batched = model(ids, mask)[:, -1]
        alone_a = model(torch.tensor([a]))[:, -1]
        alone_b = model(torch.tensor([b]))[:, -1]
    torch.testing.assert_close(batched[0], alone_a[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(batched[1], alone_b[0], rtol=1e-4, atol=1e-5)


def test_different_prompts_give_different_next_token_distributions() -> None:
    # What makes RL learn per context: a fresh model's policy must depend on the prompt's last token.
    model = build_tiny("tiny", 64, seed=2).eval()
    tok = CharTokenizer()
    with torch.no_grad():
        p = [
            torch.softmax(model(torch.tensor([tok.encode(f"target:{d}", bos=True)]))[0, -1], -1)
            for d in "0123"
        ]
    assert min((p[i] - p[j]).abs().sum().item() for i in range(4) for j in range(i + 1, 4)) > 0.1


def test_tokenizer_round_trip_and_specials() -> None:
    tok = CharTokenizer()
    ids = tok.encode("Target: 42!", bos=True, sep=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.sep_id
    assert tok.decode(ids) == "target: 42!"
    assert tok.vocab_size <= 64
    assert tok.encode("€")[0] == tok.unk_id
    with pytest.raises(KeyError, match="not in the built-in vocabulary"):
        tok.token_id("€")


def test_unknown_builtin_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown built-in model builtin://huge"):
        load_model("builtin://huge")
    with pytest.raises(ValueError, match="gs://bucket/model: only builtin://, file://, pvc:// and s3://"):
        load_model("gs://bucket/model")


def test_kv_cache_decoding_matches_full_forward() -> None:
    # The engine samples from prefill + decode; the trainer scores with forward: same logits.
    model = build_tiny("tiny", 64, seed=4).eval()
    seqs = [[1, 10, 11, 12, 13, 14, 15], [1, 20], [7], [1, *range(30, 50)]]
    cache = model.new_cache(2)
    cache.grow(len(seqs))  # rows 0..3, as the engine grows it while requests join
    width = max(len(s) for s in seqs) - 1
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s) - 1] = torch.tensor(s[:-1])
    with torch.no_grad():
        model.prefill(ids, torch.tensor([len(s) - 1 for s in seqs]), cache, torch.arange(len(seqs)))
        steps = [model.decode(torch.tensor([s[-1] for s in seqs]), cache)]
        for j in range(5):  # each row appends the same tokens, at its own position
            steps.append(model.decode(torch.full((len(seqs),), 40 + j), cache))
        for j, got in enumerate(steps):
            full = [s + list(range(40, 40 + j)) for s in seqs]
            w = max(len(s) for s in full)
            ids = torch.tensor([s + [0] * (w - len(s)) for s in full])
            mask = torch.tensor([[1] * len(s) + [0] * (w - len(s)) for s in full])
            want = model(ids, mask)[torch.arange(len(full)), torch.tensor([len(s) - 1 for s in full])]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        # a row moved into a freed row keeps decoding as before
        cache.move(3, 1)
        got = model.decode(torch.tensor([9, 9]), cache)
        alone = model(torch.tensor([[*seqs[3], *range(40, 45), 9]]))[0, -1]
        torch.testing.assert_close(got[1], alone, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="max_len"):
        model.prefill(torch.zeros(1, 129, dtype=torch.long), torch.tensor([129]), cache, torch.tensor([0]))
