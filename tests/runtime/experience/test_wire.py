"""The batched wire formats: a put of episodes and a batch of tickets pickle as builtins plus one array."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from polyrl_runtime.experience import (
    Episode,
    ExperienceBuffer,
    PolicyConfig,
    Sample,
    SampleBatch,
    Ticket,
    Turn,
)
from polyrl_runtime.experience.wire import EpisodeBatch, TicketBatch

_FIELDS = ("prompt_ids", "response_ids", "logprobs", "versions", "allowed_ids")


def _episodes() -> list[Episode]:
    odd = np.array([-0.0, np.nan, np.inf, -1e-45], dtype=np.float32)
    return [
        Episode(
            "e1",
            (
                Turn("x", "a", [1, 2], [3, 4, 5, 6], odd, [1, 1, 2, 2], allowed_ids=[3, 4, 5, 6, 9]),
                Turn("y", "b", [], [8], [-1.0], [0]),
            ),
            {"x": 1.0, "y": 0.0},
            {"group": "g1", "nested": {"k": [1, 2]}},
        ),
        Episode("e2", (Turn("x", "a", [7] * 5, [2**31 - 1], [3.5], [4]),), {"x": -2.0}),
        Episode("e3", (), {}),  # an episode with no turns (nothing to train on) still travels
    ]


def _roundtrip(obj: object) -> tuple[object, int]:
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(blob, buffers=buffers), len(buffers)


def test_an_episode_batch_is_bit_exact_and_one_buffer() -> None:
    eps = _episodes()
    tickets = [Ticket(7, frozenset({"a", "b"})), Ticket(8, frozenset({"a"})), Ticket(9, frozenset({"b"}))]
    back, n_buffers = _roundtrip(EpisodeBatch(zip(tickets, eps, strict=True)))
    assert n_buffers == 1  # Ray's per-object cost: one numpy buffer for the whole batch
    assert isinstance(back, EpisodeBatch) and len(back) == 3
    for (t0, e0), (t1, e1) in zip(zip(tickets, eps, strict=True), back, strict=True):
        assert t1 == t0
        assert (e1.episode_id, dict(e1.rewards), dict(e1.metadata)) == (
            e0.episode_id,
            dict(e0.rewards),
            dict(e0.metadata),
        )
        assert len(e1.turns) == len(e0.turns)
        for a, b in zip(e0.turns, e1.turns, strict=True):
            assert (a.agent, a.policy) == (b.agent, b.policy)
            for name in _FIELDS:
                x, y = getattr(a, name), getattr(b, name)
                assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), (e0.episode_id, name)


def test_an_empty_batch_round_trips() -> None:
    back, _ = _roundtrip(EpisodeBatch())
    assert back == EpisodeBatch()
    tickets, _ = _roundtrip(TicketBatch())
    assert tickets == TicketBatch()


def test_a_ticket_batch_round_trips_and_slices_as_a_list() -> None:
    tickets = TicketBatch([Ticket(1, frozenset({"a"})), Ticket(2, frozenset({"a", "b"}))])
    back, n_buffers = _roundtrip(tickets)
    assert n_buffers == 0 and isinstance(back, TicketBatch) and back == tickets
    assert back[1:] == [Ticket(2, frozenset({"a", "b"}))]


def test_a_buffer_takes_a_rebuilt_batch_like_the_original() -> None:
    buf = ExperienceBuffer([PolicyConfig("a", 10), PolicyConfig("b", 10)], 10)
    tickets = buf.acquire_many(["a", "b"], 3)
    batch, _ = _roundtrip(EpisodeBatch(zip(tickets, _episodes(), strict=True)))
    assert isinstance(batch, EpisodeBatch)
    buf.put_many(batch)
    a, b = buf.pull("a", "t", 10), buf.pull("b", "t", 10)
    assert a is not None and b is not None
    assert a.batch.sample_ids == ("e1/0", "e2/0") and b.batch.sample_ids == ("e1/1",)
    assert a.batch.versions.tolist() == [1, 1, 2, 2, 4] and a.batch.allowed(0).tolist() == [3, 4, 5, 6, 9]
    assert b.batch.rewards.tolist() == [0.0]
    assert buf.stats("a").admitted == 2 and buf.stats("b").admitted == 1  # e3's credit came back


def _fields(batch: SampleBatch) -> dict[str, object]:
    cols = ("turn_index", "rewards", "prompt_ids", "prompt_offsets", "response_ids", "response_offsets")
    cols += ("logprobs", "versions", "allowed_ids", "allowed_offsets")
    out: dict[str, object] = {c: np.asarray(getattr(batch, c)).tobytes() for c in cols}
    out.update(ids=batch.sample_ids, episodes=batch.episode_ids, agents=batch.agents)
    return out


def _unpacked_samples(n: int, constrained: bool) -> tuple[list[Sample], list[Sample]]:
    """Policy "a" samples of n episodes, unpacked from the wire, and the same built locally."""
    rng = np.random.default_rng(n)
    eps = []
    for i in range(n):
        allowed = rng.integers(0, 9, i % 3) if constrained else []
        turns = (
            Turn(
                "x",
                "a",
                rng.integers(0, 99, i % 4),
                rng.integers(0, 99, 1 + i % 5),
                rng.random(1 + i % 5),
                np.full(1 + i % 5, i),
                allowed_ids=allowed,
            ),
            Turn("y", "b", [1], [2, 3], [0.5, 0.25], [i, i]),
        )
        eps.append(Episode(f"e{i}", turns, {"x": float(i), "y": -1.0}))
    tickets = [Ticket(i, frozenset({"a", "b"})) for i in range(n)]
    batch, _ = _roundtrip(EpisodeBatch(zip(tickets, eps, strict=True)))
    assert isinstance(batch, EpisodeBatch)
    wired = [s for _, e in batch for s in e.samples() if s.policy == "a"]
    local = [s for e in eps for s in e.samples() if s.policy == "a"]
    return wired, local


@pytest.mark.parametrize("constrained", [False, True])
def test_consecutive_unpacked_samples_batch_as_slices_of_their_columns(constrained: bool) -> None:
    wired, local = _unpacked_samples(9, constrained)
    fast = SampleBatch.from_samples("a", wired[2:7])
    assert _fields(fast) == _fields(SampleBatch.from_samples("a", local[2:7]))
    # No copy: the batch's token columns are views of the unpacked batch's one array.
    assert np.shares_memory(fast.response_ids, wired[2].response_ids)
    assert np.shares_memory(fast.logprobs, wired[6].logprobs)
    assert [s.min_version for s in wired] == [s.min_version for s in local] == list(range(9))


def test_samples_that_are_not_consecutive_rows_are_copied_alike() -> None:
    wired, local = _unpacked_samples(6, True)
    other, _ = _unpacked_samples(3, True)
    for pick in ([0, 2, 3], [3, 2], [5]):
        got = SampleBatch.from_samples("a", [wired[i] for i in pick])
        assert _fields(got) == _fields(SampleBatch.from_samples("a", [local[i] for i in pick]))
    mixed = SampleBatch.from_samples("a", [wired[0], other[1]])
    assert not np.shares_memory(mixed.response_ids, wired[0].response_ids)
    assert mixed.sample_ids == ("e0/0", "e1/0")


def test_a_pickled_sample_keeps_only_its_own_row() -> None:
    wired, _ = _unpacked_samples(200, False)
    one = pickle.dumps(wired[0])
    assert len(one) < 2000  # not the 200-episode batch its row came from
    back = pickle.loads(one)
    assert "_row" not in back.__dict__ and back.min_version == 0
    assert back.response_ids.tolist() == wired[0].response_ids.tolist()
