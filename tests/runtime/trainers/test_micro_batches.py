"""Micro-batches group rows of similar length (padding is per micro-batch) and keep every row once."""

from __future__ import annotations

import numpy as np

from polyrl_runtime.experience.types import Sample, SampleBatch
from polyrl_runtime.trainers.deepspeed_trainer import micro_batches


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
