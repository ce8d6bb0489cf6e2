"""`engines/hf_cache.py` on the tiny Qwen2: whatever sequence of joins (prefill + concat), leaves
(select) and decoding steps a batch goes through, every row's next-token logits equal a forward pass
of that row's whole sequence alone, the width is the longest row's (no column that no row uses),
and the mask is passed only while some row is padded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from polyrl_runtime.engines.hf_cache import BatchCache, cache_argument, prefill

Op = tuple[str, Any]


def _seq(n: int, salt: int) -> list[int]:
    return [3 + (i * 53 + salt * 17) % 310 for i in range(n)]


@pytest.fixture(scope="module")
def model(tiny_qwen2_dir: Path) -> Any:
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():  # a freshly initialised model's logits are nearly flat
            if p.dim() > 1:
                p.normal_(0.0, 0.15, generator=gen)
    return m


def _alone(model: Any, seq: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([seq])).logits[0, -1]  # type: ignore[no-any-return]


CASES: dict[str, list[Op]] = {
    "equal lengths, no padding": [("join", [7, 7, 7]), ("step", 3)],
    "unequal lengths": [("join", [1, 9, 4]), ("step", 3)],
    "a wider batch joins": [("join", [3, 2]), ("step", 2), ("join", [12, 1]), ("step", 2)],
    "a narrower batch joins": [("join", [15]), ("step", 1), ("join", [2, 5]), ("step", 2)],
    "the longest row leaves": [("join", [14, 3, 5]), ("step", 2), ("keep", [2, 1]), ("step", 2)],
    "rows reordered, then more join": [
        ("join", [4, 8, 6]),
        ("step", 1),
        ("keep", [2, 0, 1]),
        ("step", 1),
        ("join", [10]),
        ("step", 2),
    ],
    "all leave, then others join": [("join", [5, 6]), ("step", 1), ("keep", []), ("join", [3]), ("step", 2)],
}


@pytest.mark.parametrize("ops", CASES.values(), ids=CASES.keys())
def test_rows_decode_as_their_whole_sequence_alone(model: Any, ops: list[Op]) -> None:
    with torch.inference_mode():
        batch = BatchCache.empty(torch.device("cpu"))
        seqs: list[list[int]] = []  # each row's sequence, its last token not yet cached

        def check(logits: torch.Tensor, rows: list[list[int]]) -> None:
            assert logits.shape[0] == len(rows)
            for row, seq in zip(logits, rows, strict=True):
                torch.testing.assert_close(row, _alone(model, seq), atol=1e-4, rtol=0)
                seq.append(int(row.argmax()))

        for salt, (op, arg) in enumerate(ops):
            if op == "join":
                new = [_seq(n, salt * 10 + i) for i, n in enumerate(arg)]
                part, logits = prefill(model, new)
                check(logits, new)
                batch, seqs = batch.concat(part), seqs + new
            elif op == "keep":
                batch, seqs = batch.select(arg), [seqs[i] for i in arg]
            else:
                for _ in range(arg):
                    logits = batch.decode(model, torch.tensor([s[-1] for s in seqs]))
                    check(logits, seqs)
            cached = [len(s) - 1 for s in seqs]
            assert batch.rows == len(seqs)
            assert batch.width == max(cached, default=0)
            assert batch.padded == (len(set(cached)) > 1)
            assert batch.positions()[:, 0].tolist() == cached


def test_prefill_refuses_empty_sequences(model: Any) -> None:
    with pytest.raises(ValueError, match="no empty one"):
        prefill(model, [[5, 6], []])
    with pytest.raises(ValueError, match="at least one"):
        prefill(model, [])


class _PastKeyValuesModel(torch.nn.Module):
    """The model with the forward signature of transformers releases before the cache argument was
    named `cache`: the cache must reach it as `past_key_values`, or each step sees one token only."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> Any:
        return self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=past_key_values,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
        )


class _NoCacheModel(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids


def test_the_cache_reaches_the_model_under_the_name_its_forward_takes(model: Any) -> None:
    old = _PastKeyValuesModel(model)
    assert (cache_argument(model), cache_argument(old)) == ("cache", "past_key_values")
    with pytest.raises(TypeError, match="takes no key/value cache"):
        cache_argument(_NoCacheModel())
    seqs = [_seq(6, 1), _seq(3, 2)]
    with torch.inference_mode():
        batch, logits = prefill(old, seqs)  # both call the model with keywords only
        for _ in range(3):
            for seq, row in zip(seqs, logits, strict=True):
                torch.testing.assert_close(row, _alone(model, seq), atol=1e-4, rtol=0)
                seq.append(int(row.argmax()))
            logits = batch.decode(old, torch.tensor([s[-1] for s in seqs]))
