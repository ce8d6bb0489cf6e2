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
from polyrl_runtime.experience.columns import PackedEpisodes
from polyrl_runtime.experience.wire import EpisodeBatch, TicketBatch

_FIELDS = ("prompt_ids", "response_ids", "logprobs", "versions", "allowed_ids")


def _episodes() -> list[Episode]:
    odd = np.array([-0.0, np.nan, np.inf, -1e-45], dtype=np.float32)
    return [
        Episode(
            "e1",
            (
                Turn(
                    "x",
                    "a",
                    [1, 2],
                    [3, 4, 5, 6],
                    odd,
                    [1, 1, 2, 2],
                    allowed_ids=[3, 4, 5, 6, 9],
                    temperature=0.7,
                ),
                Turn("y", "b", [], [8], [-1.0], [0], temperature=0.0),  # greedy
            ),
            {"x": 1.0, "y": 0.0},
            {"group": "g1", "nested": {"k": [1, 2]}},
        ),
        # Another temperature for the same policy: each turn keeps its own.
        Episode("e2", (Turn("x", "a", [7] * 5, [2**31 - 1], [3.5], [4], temperature=1.3),), {"x": -2.0}),
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
    # It arrives packed (what the buffer keeps), and still reads as the pairs it was sent as.
    assert isinstance(back, PackedEpisodes) and len(back) == 3 and back[1:][0][0] == tickets[1]
    for (t0, e0), (t1, e1) in zip(zip(tickets, eps, strict=True), back, strict=True):
        assert t1 == t0
        assert (e1.episode_id, dict(e1.rewards), dict(e1.metadata)) == (
            e0.episode_id,
            dict(e0.rewards),
            dict(e0.metadata),
        )
        assert len(e1.turns) == len(e0.turns)
        for a, b in zip(e0.turns, e1.turns, strict=True):
            assert (a.agent, a.policy, a.temperature) == (b.agent, b.policy, b.temperature)
            for name in _FIELDS:
                x, y = getattr(a, name), getattr(b, name)
                assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), (e0.episode_id, name)


def test_an_empty_batch_round_trips() -> None:
    back, _ = _roundtrip(EpisodeBatch())
    assert isinstance(back, PackedEpisodes) and list(back) == []
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
    assert isinstance(batch, PackedEpisodes)
    buf.put_many(batch)
    a, b = buf.pull("a", "t", 10), buf.pull("b", "t", 10)
    assert a is not None and b is not None
    assert a.batch.sample_ids == ("e1/0", "e2/0") and b.batch.sample_ids == ("e1/1",)
    assert a.batch.versions.tolist() == [1, 1, 2, 2, 4] and a.batch.allowed(0).tolist() == [3, 4, 5, 6, 9]
    assert b.batch.rewards.tolist() == [0.0]
    assert a.batch.temperatures.tolist() == [0.7, 1.3] and b.batch.temperatures.tolist() == [0.0]
    assert [s.temperature for s in a.batch.samples()] == [0.7, 1.3]
    assert buf.stats("a").admitted == 2 and buf.stats("b").admitted == 1  # e3's credit came back


def _fields(batch: SampleBatch) -> dict[str, object]:
    cols = (
        "turn_index",
        "rewards",
        "temperatures",
        "prompt_ids",
        "prompt_offsets",
        "response_ids",
        "response_offsets",
    )
    cols += ("logprobs", "versions", "allowed_ids", "allowed_offsets")
    out: dict[str, object] = {c: np.asarray(getattr(batch, c)).tobytes() for c in cols}
    out.update(ids=batch.sample_ids, episodes=batch.episode_ids, agents=batch.agents)
    return out


def _samples_put(n: int, constrained: bool, first: int = 0) -> tuple[PackedEpisodes, list[Sample]]:
    """A put of n episodes as it arrives from the wire, and policy "a"'s samples built locally."""
    rng = np.random.default_rng(n + first)
    eps = []
    for i in range(first, first + n):
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
                temperature=0.25 * (i % 4),  # rows of one policy at different temperatures
            ),
            Turn("y", "b", [1], [2, 3], [0.5, 0.25], [i, i], temperature=1.5),
        )
        eps.append(Episode(f"e{i}", turns, {"x": float(i), "y": -1.0}))
    tickets = [Ticket(i + 1, frozenset({"a", "b"})) for i in range(first, first + n)]
    batch, _ = _roundtrip(EpisodeBatch(zip(tickets, eps, strict=True)))
    assert isinstance(batch, PackedEpisodes)
    return batch, [s for e in eps for s in e.samples() if s.policy == "a"]


def _buffer(n: int) -> ExperienceBuffer:
    buf = ExperienceBuffer([PolicyConfig("a", 1000), PolicyConfig("b", 1000)], 1000)
    assert len(buf.acquire_many(["a", "b"], n)) == n
    return buf


@pytest.mark.parametrize("constrained", [False, True])
def test_a_lease_of_one_put_is_slices_of_its_columns(constrained: bool) -> None:
    put, local = _samples_put(9, constrained)
    buf = _buffer(9)
    buf.put_many(put)
    first, lease = buf.pull("a", "t", 2), buf.pull("a", "t", 5)
    assert first is not None and lease is not None
    assert _fields(lease.batch) == _fields(SampleBatch.from_samples("a", local[2:7]))
    # No copy: the lease's token columns are views of the put's one array.
    assert np.shares_memory(lease.batch.response_ids, put.flat)
    assert np.shares_memory(lease.batch.logprobs, put.flat)


def test_a_lease_across_puts_and_redeliveries_is_copied_alike() -> None:
    one, local_one = _samples_put(4, True)
    two, local_two = _samples_put(3, True, first=4)
    buf = _buffer(7)
    buf.put_many(one)
    buf.put_many(two)
    head = buf.pull("a", "t", 2)
    assert head is not None
    buf.nack(head.lease_id)  # redelivered first: rows 0-1 of the first put, then 2-3, then the second
    lease = buf.pull("a", "t", 6)
    assert lease is not None
    assert _fields(lease.batch) == _fields(SampleBatch.from_samples("a", (local_one + local_two)[:6]))
    assert not np.shares_memory(lease.batch.response_ids, one.flat)


def test_a_snapshot_keeps_only_the_rows_still_held() -> None:
    put, _ = _samples_put(200, False)
    buf = _buffer(200)
    buf.put_many(put)
    for policy in ("a", "b"):
        lease = buf.pull(policy, "t", 200 if policy == "b" else 199)
        assert lease is not None
        buf.ack(lease.lease_id)
    snap = buf.snapshot()
    assert [s.sample_id for s in snap.samples["a"]] == ["e199/0"] and snap.samples["b"] == []
    assert len(pickle.dumps(snap)) < 4000  # not the 200-episode put its row came from
    back = ExperienceBuffer.restore(pickle.loads(pickle.dumps(snap)))
    lease = back.pull("a", "t", 5)
    assert lease is not None and lease.batch.sample_ids == ("e199/0",)
    assert lease.batch.versions.tolist() == [199] * 5
    assert lease.batch.temperatures.tolist() == [0.75]  # the row's own, through the snapshot


def test_a_lease_of_a_whole_put_pickles_as_a_view_of_the_put() -> None:
    put, _ = _samples_put(6, False)
    buf = _buffer(6)
    buf.put_many(put)
    lease = buf.pull("a", "t", 6)
    assert lease is not None
    back, n_buffers = _roundtrip(lease.batch)
    assert isinstance(back, SampleBatch) and _fields(back) == _fields(lease.batch)
    buffers: list[pickle.PickleBuffer] = []
    pickle.dumps(lease.batch, protocol=5, buffer_callback=buffers.append)
    # One buffer, and no copy: the rows' columns already lie back to back in the put's array.
    assert n_buffers == 1 and np.shares_memory(np.asarray(buffers[0].raw()), put.flat)


@pytest.mark.parametrize("constrained", [False, True])
def test_any_sample_batch_pickles_bit_exact_as_one_buffer(constrained: bool) -> None:
    put, local = _samples_put(7, constrained)
    buf = _buffer(7)
    buf.put_many(put)
    part = buf.pull("a", "t", 3)  # some rows of a put: not back to back, so copied
    assert part is not None
    for batch in (part.batch, SampleBatch.from_samples("a", local), SampleBatch.from_samples("a", [])):
        back, n_buffers = _roundtrip(batch)
        assert isinstance(back, SampleBatch) and _fields(back) == _fields(batch)
        assert n_buffers == 1
        assert [s.allowed_ids.tolist() for s in back.samples()] == [
            s.allowed_ids.tolist() for s in batch.samples()
        ]
        assert [s.temperature for s in back.samples()] == [s.temperature for s in batch.samples()]
