"""The batched wire formats: a put of episodes and a batch of tickets pickle as builtins plus one array."""

from __future__ import annotations

import pickle

import numpy as np

from polyrl_runtime.experience import Episode, ExperienceBuffer, PolicyConfig, Ticket, Turn
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
