"""Whether a teacher can score a student's token ids (on-policy distillation): the same vocabulary
size, end ids and encoding, or a reason naming what differs."""

from __future__ import annotations

from polyrl_runtime.models import CharTokenizer, load_tokenizer, vocabulary_mismatch


def test_the_same_tokenizer_matches_and_another_is_refused_with_the_reason() -> None:
    char = CharTokenizer()
    assert vocabulary_mismatch(char, CharTokenizer()) is None
    qwen = load_tokenizer("builtin://tiny-qwen2")
    assert vocabulary_mismatch(qwen, load_tokenizer("builtin://tiny-qwen2")) is None
    reason = vocabulary_mismatch(char, qwen)
    assert reason is not None and "vocabulary sizes differ" in reason
