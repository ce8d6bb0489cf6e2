"""A canonical order of a batch's samples, independent of the order they reached the buffer.

Episodes reach the buffer in the order they finish, which depends on scheduling. Floating-point sums
over a batch (the loss of a micro-batch, the gradients accumulated over micro-batches) depend on the
order of their terms, so a trainer that walks its rows in arrival order computes a slightly different
update each run. Ranking rows by (episode id, turn index, agent) instead makes a seeded sync job's
update a function of which samples it trains on only.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from polyrl_runtime.experience.batches import SampleBatch


def canonical_rank(batch: SampleBatch) -> npt.NDArray[np.int64]:
    """Per row, its position when the batch is sorted by (episode id, turn index, agent)."""
    keys = list(zip(batch.episode_ids, batch.turn_index.tolist(), batch.agents, strict=True))
    order = sorted(range(len(keys)), key=keys.__getitem__)
    rank = np.empty(len(keys), dtype=np.int64)
    rank[order] = np.arange(len(keys), dtype=np.int64)
    return rank
