"""Trainer rows are ordered by what the samples are, not by when they reached the buffer."""

from __future__ import annotations

import random

import numpy as np

from polyrl_runtime.experience.batches import SampleBatch
from polyrl_runtime.experience.ordering import canonical_rank
from polyrl_runtime.experience.types import Sample
from polyrl_runtime.trainers.batching import micro_batches


def _sample(episode: str, turn: int, agent: str, length: int) -> Sample:
    return Sample(
        sample_id=f"{episode}/{agent}/{turn}",
        episode_id=episode,
        policy="p",
        agent=agent,
        turn_index=turn,
        prompt_ids=np.arange(3, dtype=np.int32),
        response_ids=np.arange(length, dtype=np.int32),
        logprobs=np.zeros(length, dtype=np.float32),
        versions=np.zeros(length, dtype=np.int32),
        reward=0.0,
    )


SAMPLES = [
    _sample(f"g{g}-{i}", t, a, length=1 + (g + i + t) % 3)
    for g in range(3)
    for i in range(4)
    for t in range(2)
    for a in ("alice", "bob")
]


def test_canonical_rank_sorts_by_episode_turn_agent() -> None:
    shuffled = SAMPLES[:]
    random.Random(0).shuffle(shuffled)
    batch = SampleBatch.from_samples("p", shuffled)
    rank = canonical_rank(batch)
    by_rank = [batch.sample_ids[i] for i in np.argsort(rank)]
    keys = sorted((s.episode_id, s.turn_index, s.agent, s.sample_id) for s in SAMPLES)
    assert by_rank == [k[-1] for k in keys]


def test_micro_batches_do_not_depend_on_arrival_order() -> None:
    layouts = set()
    for seed in range(5):
        shuffled = SAMPLES[:]
        random.Random(seed).shuffle(shuffled)
        batch = SampleBatch.from_samples("p", shuffled)
        rows = micro_batches(batch, 5, 11)
        layouts.add(tuple(tuple(batch.sample_ids[i] for i in m) for m in rows))
    assert len(layouts) == 1
    (layout,) = layouts
    assert sum(len(m) for m in layout) == len(SAMPLES)
