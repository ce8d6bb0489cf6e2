"""Decoding constraints (Turn.allowed_ids) must survive every hop to the trainer: pickling an episode
(Ray), splitting it into samples, batching them and unbatching; without them the trainer's logprobs
would differ from the engine's and every sample would look off-policy."""

from __future__ import annotations

import pickle

import numpy as np
import ray

from polyrl_runtime.experience.batches import SampleBatch
from polyrl_runtime.experience.types import Episode, Turn


def _episode() -> Episode:
    t1 = Turn("speaker", "p", [1, 2], [30], [-0.5], [3], allowed_ids=[30, 31, 32])
    t2 = Turn("listener", "p", [1, 4, 30], [7, 8], [-0.1, -0.2], [3, 3])
    return Episode("e1", (t1, t2), {"speaker": 1.0, "listener": 0.5})


def test_allowed_ids_survive_pickle_samples_and_batches() -> None:
    for ep in (
        pickle.loads(pickle.dumps(_episode())),
        ray.cloudpickle.loads(ray.cloudpickle.dumps(_episode())),
    ):
        assert ep.turns[0].allowed_ids.tolist() == [30, 31, 32] and len(ep.turns[1].allowed_ids) == 0
        assert ep.turns[1].response_ids.tolist() == [7, 8] and ep.turns[1].versions.tolist() == [3, 3]
        batch = pickle.loads(pickle.dumps(SampleBatch.from_samples("p", ep.samples())))
        back = batch.samples()
        assert back[0].allowed_ids.tolist() == [30, 31, 32] and back[1].allowed_ids.size == 0
        np.testing.assert_array_equal(batch.allowed(0), [30, 31, 32])
