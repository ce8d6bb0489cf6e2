"""Micro-batches group rows of similar length (padding is per micro-batch) and keep every row once;
with a token budget each one's padded size (rows x longest row) stays within it."""

from __future__ import annotations

import numpy as np
import pytest

from polyrl_runtime.experience.batches import SampleBatch
from polyrl_runtime.experience.types import Sample
from polyrl_runtime.trainers.batching import (
    micro_batches,
    pack_rows,
    pad_to,
    share_micro_batches,
    split_to,
    step_layout,
)


def _batch(response_lengths: list[int]) -> SampleBatch:
    samples = [
        Sample(
            sample_id=f"s{i}",
            episode_id=f"e{i}",
            policy="p",
            agent="a",
            turn_index=0,
            reward=0.0,
            prompt_ids=np.arange(3, dtype=np.int32),
            response_ids=np.ones(n, dtype=np.int32),
            logprobs=np.zeros(n, dtype=np.float32),
            versions=np.zeros(n, dtype=np.int32),
        )
        for i, n in enumerate(response_lengths)
    ]
    return SampleBatch.from_samples("p", samples)


def test_rows_are_grouped_by_length_and_each_taken_once() -> None:
    lengths = [90, 1, 60, 1, 1, 75, 2, 1]
    rows = micro_batches(_batch(lengths), micro=4, n_micro=2)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert [sorted(lengths[i] for i in r) for r in rows] == [[1, 1, 1, 1], [2, 60, 75, 90]]


def test_empty_micro_batches_pad_to_the_ranks_common_count() -> None:
    assert micro_batches(_batch([5, 3]), micro=4, n_micro=3) == [[1, 0], [], []]
    assert micro_batches(None, micro=4, n_micro=2) == [[], []]


@pytest.mark.parametrize(
    ("lengths", "budget", "expected"),
    [
        # Short rows share a micro-batch; the long ones get fewer rows each.
        ([10, 10, 10, 10, 40, 40], 40, [[0, 1, 2, 3], [4], [5]]),
        ([10, 10, 10, 10, 40, 40], 80, [[0, 1, 2, 3], [4, 5]]),
        # Sorted first: the padded size is counted against the longest row so far.
        ([40, 10, 20, 10], 40, [[1, 3], [2], [0]]),
        ([5, 6, 7], 18, [[0, 1], [2]]),  # 3 rows x 7 = 21 > 18
        ([5, 6, 7], 21, [[0, 1, 2]]),
        # A row longer than the budget trains alone rather than being dropped.
        ([100, 3], 50, [[1], [0]]),
        ([], 64, []),
    ],
)
def test_token_budget_packs_sorted_rows_within_the_budget(
    lengths: list[int], budget: int, expected: list[list[int]]
) -> None:
    groups = pack_rows(np.array(lengths, dtype=np.int64), micro=1000, max_tokens=budget)
    assert groups == expected
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= budget


@pytest.mark.parametrize(
    ("lengths", "micro", "expected"),
    [
        ([3, 1, 2, 5, 4], 2, [[1, 2], [0, 4], [3]]),
        ([3, 1, 2], 5, [[1, 2, 0]]),
        ([2, 2, 2], 1, [[0], [1], [2]]),
    ],
)
def test_rows_without_a_budget(lengths: list[int], micro: int, expected: list[list[int]]) -> None:
    assert pack_rows(np.array(lengths, dtype=np.int64), micro) == expected


def test_token_budget_through_a_sample_batch() -> None:
    # prompt 3 + response: rows of 4, 4, 33, 63, 93 tokens
    batch = _batch([1, 1, 30, 60, 90])
    rows = micro_batches(batch, micro=8, n_micro=4, max_tokens=99)  # 3 x 33 fits, 2 x 63 does not
    assert rows == [[0, 1, 2], [3], [4], []]
    with pytest.raises(ValueError, match="common count 2"):
        micro_batches(batch, micro=8, n_micro=2, max_tokens=99)


def test_equal_lengths_are_ordered_by_sample_not_arrival() -> None:
    batch = _batch([2, 2, 2, 2])
    assert micro_batches(batch, micro=2, n_micro=2, max_tokens=10) == micro_batches(batch, micro=2, n_micro=2)


@pytest.mark.parametrize(("micro", "budget"), [(0, None), (4, 0)])
def test_limits_must_be_positive(micro: int, budget: int | None) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        pack_rows(np.array([1, 2], dtype=np.int64), micro, budget)


def test_pad_to_adds_empty_micro_batches() -> None:
    assert pad_to([[0], [1]], 4) == [[0], [1], [], []]


# -- mini-batches ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "count", "want"),
    [
        ([[0, 1, 2, 3]], 1, [[0, 1, 2, 3]]),
        ([[0, 1, 2, 3]], 2, [[0, 1], [2, 3]]),
        ([[0, 1, 2, 3, 4]], 4, [[0], [1], [2], [3, 4]]),
        ([[0], [1, 2]], 3, [[0], [1], [2]]),
        ([[0], [1]], 4, [[0], [1]]),  # a row is not split: fewer groups than asked
        ([], 2, []),
    ],
)
def test_a_share_is_split_until_each_mini_batch_has_rows(
    groups: list[list[int]], count: int, want: list[list[int]]
) -> None:
    assert split_to(groups, count) == want


@pytest.mark.parametrize(
    ("local", "n_micro", "minis", "want_count", "want_minis"),
    [
        (3, 3, 1, 3, [[0, 1, 2]]),  # one optimizer step: every micro-batch accumulated
        (3, 3, None, 3, [[0], [1], [2]]),  # ppo's default: one per micro-batch
        (4, 4, 2, 4, [[0, 2], [1, 3]]),  # dealt in turn: each spans the lengths
        (3, 3, 2, 4, [[0, 2], [1, 3]]),  # padded to a multiple of the mini-batches
        (2, 1, 2, 2, [[0], [1]]),  # more mini-batches than the ranks' micro-batches: split rows
    ],
)
def test_every_mini_batch_has_the_same_number_of_micro_batches(
    local: int, n_micro: int, minis: int | None, want_count: int, want_minis: list[list[int]]
) -> None:
    groups = [[i] for i in range(local)]
    layout = step_layout(groups, n_micro, minis)
    assert len(layout.micro_rows) == want_count and layout.mini_batches() == want_minis
    assert layout.per_mini * layout.minis == want_count
    assert layout.micro_rows[:local] == groups and all(not r for r in layout.micro_rows[local:])


def test_a_mini_batch_count_splits_a_share_of_one_micro_batch() -> None:
    batch = _batch([5, 1, 3, 2])
    assert share_micro_batches(batch, micro=4) == [[1, 3, 2, 0]]
    assert share_micro_batches(batch, micro=4, minis=2) == [[1, 3], [2, 0]]
    assert share_micro_batches(batch, micro=4, minis=1) == share_micro_batches(batch, micro=4)


def test_a_layout_needs_a_micro_batch_and_a_mini_batch() -> None:
    with pytest.raises(ValueError, match="micro-batches 0"):
        step_layout([], 0, 1)
    with pytest.raises(ValueError, match="mini 0"):
        step_layout([], 1, 0)
