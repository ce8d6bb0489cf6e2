"""The loss mask of a conversation's context tokens survives every hop: the episode wire format, the
buffer's columns and leases, sample batches pickled for a trainer, and a buffer snapshot restored."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from polyrl_runtime.experience import Episode, ExperienceBuffer, PolicyConfig, Turn
from polyrl_runtime.experience.types import CONTEXT

C = CONTEXT
# A conversation: sampled (versions 3, 4), context, sampled again (version 5).
CONV = Turn("solver", "p", [1, 2], [10, 11, 20, 21, 22, 12], [-0.5, -0.25, 0, 0, 0, -1.0], [3, 4, C, C, C, 5])
MASK = [True, True, False, False, False, True]
SINGLE = Turn("judge", "p", [9], [30, 31], [-0.1, -0.2], [2, 2])


def _episode(eid: str) -> Episode:
    return Episode(eid, (CONV, SINGLE), {"solver": 1.0, "judge": 0.0})


def test_turn_validation_of_context_tokens() -> None:
    assert CONV.loss_mask.tolist() == MASK and CONV.min_version == 3
    with pytest.raises(ValueError, match="no sampled token"):
        Turn("a", "p", [1], [2, 3], [0, 0], [C, C])
    with pytest.raises(ValueError, match="context tokens must have logprob 0"):
        Turn("a", "p", [1], [2, 3], [-1.0, -1.0], [0, C])


def test_episode_pickle_keeps_the_mask() -> None:
    back = pickle.loads(pickle.dumps(_episode("e1")))
    assert back.turns[0].loss_mask.tolist() == MASK and back.turns[0].min_version == 3
    assert [s.min_version for s in back.samples()] == [3, 2]


def test_buffer_lease_snapshot_and_restore_keep_the_mask() -> None:
    buf = ExperienceBuffer([PolicyConfig("p", 2, max_staleness=4)], 10)
    tickets = [buf.acquire(["p"]) for _ in range(2)]
    for i, t in enumerate(tickets):
        assert t is not None
        buf.put(t, _episode(f"e{i}"))
    restored = ExperienceBuffer.restore(pickle.loads(pickle.dumps(buf.snapshot())))
    for b in (buf, restored):
        lease = b.pull("p", "trainer", 8)
        assert lease is not None
        batch = pickle.loads(pickle.dumps(lease.batch))  # as a trainer receives it
        assert batch.loss_mask.tolist() == ([*MASK, True, True]) * 2
        assert batch.trained_tokens == 2 * (3 + 2)
        assert [s.loss_mask.tolist() for s in batch.samples()] == [MASK, [True, True]] * 2
        assert [s.min_version for s in batch.samples()] == [3, 2, 3, 2]


def test_context_tokens_do_not_make_a_sample_stale() -> None:
    # Staleness is measured from the oldest sampled token (3), not from the context marker.
    buf = ExperienceBuffer([PolicyConfig("p", 1, max_staleness=2)], 10)
    t = buf.acquire(["p"])
    assert t is not None
    buf.put(t, Episode("e", (CONV,), {"solver": 1.0}))
    buf.advance("p", 5)
    assert buf.stats("p").buffered == 1
    assert np.array_equal(pickle.loads(pickle.dumps(CONV)).versions, CONV.versions)
