"""Micro-batches: which rows of a rank's share go through one forward/backward pass together.

Rows are sorted by sequence length (prompt + response) first: a micro-batch is padded to its longest
row, so mixing short turns with long ones (a long-tail reply beside one-token answers) would pay for
the long one in every row. A mini-batch sums its micro losses into one optimizer step, so grouping
does not change its gradient; ppo's default, one mini-batch per micro-batch, updates on rows grouped
by length instead of by arrival, an order as arbitrary as before.

Two ways to cut the sorted rows:
- by rows (`trainer.microBatchSize`): at most `micro` rows each;
- by tokens (`trainer.maxTokensPerMicroBatch`): as many rows as keep the padded size, rows x longest
  row, within the budget (a row longer than the budget goes alone), so long sequences get small
  micro-batches and short ones large.

The count then differs between ranks; every rank must run the same number of passes (each backward
is collective under ZeRO), so ranks agree on the largest count and pad with empty micro-batches.

Mini-batches (`algorithm.miniBatches`): the micro-batches are dealt to the mini-batches in turn,
mini-batch j accumulating micro-batches j, j + miniBatches, ..., so each mini-batch spans the share's
lengths rather than holding its shortest or longest rows; every mini-batch has the same number of
micro-batches (the count is padded to a multiple of miniBatches), so every rank reaches each
accumulation boundary, one optimizer step, at the same pass. A share that packs into fewer
micro-batches than mini-batches has its largest ones halved first, so each mini-batch gets rows
while the share has as many rows as mini-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from polyrl_runtime.experience.batches import SampleBatch
from polyrl_runtime.experience.ordering import canonical_rank


def row_lengths(batch: SampleBatch | None) -> npt.NDArray[np.int64]:
    """Tokens of each row (prompt + response), the width it pads its micro-batch to."""
    if batch is None:
        return np.zeros(0, dtype=np.int64)
    return (np.diff(batch.prompt_offsets) + np.diff(batch.response_offsets)).astype(np.int64)


def pack_rows(
    lengths: npt.NDArray[np.int64],
    micro: int,
    max_tokens: int | None = None,
    tiebreak: npt.NDArray[np.int64] | None = None,
) -> list[list[int]]:
    """Row indices of each micro-batch, rows in ascending length order (equal lengths by `tiebreak`,
    else by index): `micro` rows at a time, or with `max_tokens` as many as keep
    rows x longest row <= max_tokens (never fewer than one row)."""
    if micro < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"micro-batch limits must be positive (rows {micro}, tokens {max_tokens})")
    keys = (np.arange(len(lengths)) if tiebreak is None else tiebreak, lengths)
    order = [int(i) for i in np.lexsort(keys)]
    if max_tokens is None:
        return [order[i : i + micro] for i in range(0, len(order), micro)]
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Ascending order: the row being added is the longest of its micro-batch.
        if current and (len(current) + 1) * int(lengths[i]) > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def pad_to(groups: list[list[int]], n_micro: int) -> list[list[int]]:
    """`groups` followed by empty micro-batches up to `n_micro` (the count every rank runs)."""
    if len(groups) > n_micro:
        raise ValueError(f"{len(groups)} micro-batches do not fit the ranks' common count {n_micro}")
    return groups + [[] for _ in range(n_micro - len(groups))]


def share_micro_batches(
    batch: SampleBatch | None, micro: int, max_tokens: int | None = None, minis: int | None = None
) -> list[list[int]]:
    """Row indices of each of the share's micro-batches (see `pack_rows`), before padding; with
    `minis`, split to at least that many while the rows allow (`split_to`). Equal lengths are ordered
    by a canonical rank, not arrival order: the same samples give the same micro-batches, and so the
    same update."""
    tiebreak = None if batch is None else canonical_rank(batch)
    groups = pack_rows(row_lengths(batch), micro, max_tokens, tiebreak)
    return groups if minis is None else split_to(groups, minis)


def micro_batches(
    batch: SampleBatch | None, micro: int, n_micro: int, max_tokens: int | None = None
) -> list[list[int]]:
    """Row indices of each of `n_micro` micro-batches (`share_micro_batches`), empty ones padding the
    list."""
    return pad_to(share_micro_batches(batch, micro, max_tokens), n_micro)


def split_to(groups: list[list[int]], count: int) -> list[list[int]]:
    """`groups` with the one of most rows (the first such) halved in place, order kept, until there
    are `count` of them or every one is a single row."""
    out = [list(g) for g in groups]
    while 0 < len(out) < count:
        k = max(range(len(out)), key=lambda i: len(out[i]))
        if len(out[k]) < 2:
            break
        half = len(out[k]) // 2
        out[k : k + 1] = [out[k][:half], out[k][half:]]
    return out


@dataclass(frozen=True)
class StepLayout:
    """A rank's passes of one step: its micro-batches (row indices; empty ones pad to the count every
    rank runs) and `minis` mini-batches of `per_mini` micro-batches each, one optimizer step per
    mini-batch per epoch."""

    micro_rows: list[list[int]]
    minis: int

    @property
    def per_mini(self) -> int:
        return len(self.micro_rows) // self.minis

    def mini_batches(self) -> list[list[int]]:
        """Each mini-batch's micro-batch indices: j, j + minis, ... (module docstring)."""
        return [list(range(j, len(self.micro_rows), self.minis)) for j in range(self.minis)]


def step_layout(groups: list[list[int]], n_micro: int, minis: int | None) -> StepLayout:
    """`groups` (this rank's micro-batches) padded to the ranks' common count: `n_micro` (no rank has
    more), rounded up to a multiple of `minis`; `minis` None: one mini-batch per micro-batch."""
    if n_micro < 1 or (minis is not None and minis < 1):
        raise ValueError(
            f"a step needs a micro-batch and a mini-batch (micro-batches {n_micro}, mini {minis})"
        )
    count = n_micro if minis is None else minis * math.ceil(n_micro / minis)
    return StepLayout(pad_to(groups, count), count if minis is None else minis)
