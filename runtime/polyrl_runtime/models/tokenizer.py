"""The built-in character tokenizer of `builtin://` models: fixed vocabulary, no files, no downloads.

Lower-case letters, digits, space and common punctuation map to one token each (upper case is folded
to lower case); anything else becomes `<unk>`. Small on purpose: the tiny model's output layer is the
vocabulary, so a small vocabulary is what makes it learn in seconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SPECIALS = ("<pad>", "<bos>", "<eos>", "<sep>", "<unk>")
CHARS = " 0123456789abcdefghijklmnopqrstuvwxyz.,:;!?-+*/=()<>'\"_#"


class CharTokenizer:
    """Maps text to token ids and back; ids are stable across versions (append-only vocabulary)."""

    def __init__(self) -> None:
        self.itos: list[str] = [*SPECIALS, *CHARS]
        self.stoi: dict[str, int] = {s: i for i, s in enumerate(self.itos)}
        self.pad_id = self.stoi["<pad>"]
        self.bos_id = self.stoi["<bos>"]
        self.eos_id = self.stoi["<eos>"]
        self.sep_id = self.stoi["<sep>"]
        self.unk_id = self.stoi["<unk>"]
        self.stop_ids: tuple[int, ...] = (self.eos_id,)

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, *, bos: bool = False, sep: bool = False) -> list[int]:
        ids = [self.stoi.get(c, self.unk_id) for c in text.lower()]
        return ([self.bos_id] if bos else []) + ids + ([self.sep_id] if sep else [])

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        out = []
        for i in ids:
            tok = self.itos[i] if 0 <= i < len(self.itos) else "<unk>"
            if skip_special and tok in SPECIALS:
                continue
            out.append(tok)
        return "".join(out)

    def token_id(self, piece: str) -> int:
        """The id of one character or special token (KeyError if it is not in the vocabulary)."""
        try:
            return self.stoi[piece if piece in SPECIALS else piece.lower()]
        except KeyError:
            raise KeyError(f"{piece!r} is not in the built-in vocabulary") from None

    @property
    def has_chat_template(self) -> bool:
        return False

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        raise ValueError(
            "the built-in character tokenizer has no chat template: prompt builtin:// models with "
            "plain text, or use a Hugging Face model (e.g. builtin://tiny-qwen2)"
        )

    def ids_of(self, pieces: Sequence[str]) -> list[int]:
        return [self.token_id(p) for p in pieces]
