"""Buffer behaviour the state machine does not spell out: typed records, blocking, tickets, batches."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from polyrl_runtime.experience import (
    DropReason,
    Episode,
    ExperienceBuffer,
    PolicyConfig,
    SampleBatch,
    Ticket,
    Turn,
    UnknownTicketError,
)


def turn(policy: str, version: int = 0, n: int = 3, agent: str | None = None) -> Turn:
    return Turn(agent or policy, policy, [7, 8], list(range(n)), [-0.1] * n, [version] * n)


def episode(eid: str, *turns: Turn) -> Episode:
    return Episode(eid, turns, {t.agent: 0.5 for t in turns}, {"seed": 1})


def test_turn_and_episode_validation() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        Turn("a", "p", [1], [1, 2], [0.0], [0, 0])
    with pytest.raises(ValueError, match="no response tokens"):
        Turn("a", "p", [1], [], [], [])
    with pytest.raises(ValueError, match="one-dimensional"):
        Turn("a", "p", [[1]], [1], [0.0], [0])
    with pytest.raises(ValueError, match="no reward"):
        Episode("e", (turn("p"),), {"someone-else": 1.0})
    t = turn("p")
    assert t.prompt_ids.dtype == np.int32 and t.logprobs.dtype == np.float32
    assert t.temperature == 1.0  # a hand-built turn without one
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="agent 'a': temperature must be finite and >= 0"):
            Turn("a", "p", [1], [2], [0.0], [0], temperature=bad)
    greedy = Turn("a", "p", [1], [2], [0.0], [0], temperature=0)
    assert greedy.temperature == 0.0 and type(greedy.temperature) is float
    assert type(Turn("a", "p", [1], [2], [0.0], [0], temperature=np.float32(0.5)).temperature) is float


def test_turn_keeps_matching_arrays_and_converts_the_rest() -> None:
    ids = np.arange(6, dtype=np.int32)
    lp = np.zeros(3, dtype=np.float32)
    kept = Turn("a", "p", ids, ids[:3], lp, ids[3:])
    assert kept.prompt_ids is ids and kept.logprobs is lp  # already int32/float32, 1-D, contiguous
    assert kept.allowed_ids.dtype == np.int32 and len(kept.allowed_ids) == 0
    converted = Turn("a", "p", ids.astype(np.int64), ids[::2], lp.astype(np.float64), [0, 0, 0])
    assert converted.prompt_ids.dtype == np.int32 and converted.logprobs.dtype == np.float32
    assert converted.response_ids.flags.c_contiguous and converted.response_ids.tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="prompt_ids must be one-dimensional"):
        Turn("a", "p", ids.reshape(2, 3), ids[:3], lp, ids[3:])


def test_split_and_batch_round_trip() -> None:
    ep = Episode(
        "e1",
        (
            turn("speaker", 3, agent="s"),
            turn("listener", 2, n=5, agent="l"),
            turn("speaker", 4, n=1, agent="s"),
        ),
        {"s": 1.0, "l": -1.0},
    )
    samples = ep.samples()
    assert [s.sample_id for s in samples] == ["e1/0", "e1/1", "e1/2"]
    assert [s.reward for s in samples] == [1.0, -1.0, 1.0]
    speaker = [s for s in samples if s.policy == "speaker"]
    batch = SampleBatch.from_samples("speaker", speaker)
    assert len(batch) == 2 and list(batch.response_offsets) == [0, 3, 4]
    back = batch.samples()
    for a, b in zip(speaker, back, strict=True):
        assert a.sample_id == b.sample_id and a.reward == b.reward and a.min_version == b.min_version
        assert np.array_equal(a.response_ids, b.response_ids) and np.array_equal(a.logprobs, b.logprobs)
        assert np.array_equal(a.prompt_ids, b.prompt_ids) and np.array_equal(a.versions, b.versions)


def test_ticket_rules() -> None:
    buf = ExperienceBuffer([PolicyConfig("a", 2), PolicyConfig("b", 2)], 10)
    t = buf.acquire(["a"])
    assert t is not None
    with pytest.raises(ValueError, match="without credit"):
        buf.put(t, episode("e", turn("b")))
    buf.put(t, episode("e", turn("a")))
    with pytest.raises(UnknownTicketError):
        buf.put(t, episode("e2", turn("a")))  # a ticket is good for one episode
    with pytest.raises(UnknownTicketError):
        buf.release(Ticket(999, frozenset({"a"})))
    with pytest.raises(KeyError, match="unknown policy"):
        buf.acquire(["zz"])


def test_sync_mode_generates_one_step_per_version() -> None:
    buf = ExperienceBuffer([PolicyConfig("a", episodes_per_version=2, max_staleness=0)], 100)
    tickets = [buf.acquire(["a"]) for _ in range(3)]
    assert tickets[2] is None  # two episodes per version, none ahead
    for i, t in enumerate(tickets[:2]):
        assert t is not None
        buf.put(t, episode(f"e{i}", turn("a")))
    lease = buf.pull("a", "trainer", 8)
    assert lease is not None and len(lease.batch) == 2
    buf.ack(lease.lease_id)
    assert buf.acquire(["a"]) is None
    buf.advance("a", 1)
    assert buf.acquire(["a"]) is not None


def test_stale_samples_dropped_with_reason_and_credit_returned() -> None:
    buf = ExperienceBuffer([PolicyConfig("a", 1, max_staleness=1)], 100)
    t0, t1 = buf.acquire(["a"]), buf.acquire(["a"])
    assert t0 is not None and t1 is not None and buf.acquire(["a"]) is None
    buf.put(t0, episode("e0", turn("a", version=0)))
    buf.advance("a", 2)  # e0 is now two versions behind
    s = buf.stats("a")
    assert s.dropped[DropReason.STALE] == 1 and s.buffered == 0 and s.produced == 1
    assert s.credit == (2 + 1 + 1) * 1 - 1  # e0's credit came back; t1 still holds one


def test_blocking_pull_and_acquire_wake_up() -> None:
    buf = ExperienceBuffer([PolicyConfig("a", 1, max_staleness=0)], 100)
    got: list[object] = []
    consumer = threading.Thread(target=lambda: got.append(buf.pull("a", "t", 4, timeout=None)))
    consumer.start()
    t = buf.acquire(["a"])
    assert t is not None
    waiter = threading.Thread(target=lambda: got.append(buf.acquire(["a"], timeout=None)))
    waiter.start()  # no credit until the trainer advances
    buf.put(t, episode("e", turn("a")))
    consumer.join()
    buf.advance("a", 1)
    waiter.join()
    assert got[0] is not None and got[1] is not None


def test_wait_buffered_wakes_on_put_and_times_out() -> None:
    # The driver's long poll for a full step: answered as soon as the samples are there.
    buf = ExperienceBuffer([PolicyConfig("a", 2, max_staleness=0)], 100)
    assert not buf.wait_buffered("a", 1, timeout=0.01)
    t = buf.acquire(["a"])
    assert t is not None
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(buf.wait_buffered("a", 1, timeout=30)))
    waiter.start()
    buf.put(t, episode("e", turn("a")))
    waiter.join(timeout=10)
    assert woke == [True] and buf.wait_buffered("a", 1, timeout=0)


def test_finished_policy_drops_late_arrivals_and_redeliveries() -> None:
    buf = ExperienceBuffer([PolicyConfig("a", 5, 1), PolicyConfig("b", 5, 1)], 100)
    t = buf.acquire(["a", "b"])
    assert t is not None
    buf.put(t, episode("e0", turn("a"), turn("b")))
    lease = buf.pull("a", "t", 1)
    assert lease is not None
    t2 = buf.acquire(["a", "b"])
    assert t2 is not None
    buf.finish("a")
    buf.put(t2, episode("e1", turn("a"), turn("b")))
    buf.consumer_failed("t")
    a, b = buf.stats("a"), buf.stats("b")
    assert a.dropped[DropReason.POLICY_FINISHED] == 2 and a.buffered == 0 and a.produced == 2
    assert b.buffered == 2 and b.dropped[DropReason.POLICY_FINISHED] == 0
    # An episode for a finished policy alone is not started: nothing of it could be trained on.
    assert buf.acquire(["a"]) is None and buf.acquire(["a", "b"]) is not None
    buf.finish("b")
    assert buf.acquire(["a", "b"]) is None


def test_a_restarting_policy_holds_no_episode_back_and_keeps_what_it_had() -> None:
    buf = ExperienceBuffer([PolicyConfig("a", 2, 0, final_version=4), PolicyConfig("b", 2, 1)], 100)
    first = [buf.acquire(["a", "b"]) for _ in range(2)]
    assert all(first) and buf.acquire(["a", "b"]) is None  # a's credit for its version 0 is used up
    buf.put(first[0], episode("e0", turn("a"), turn("b")))  # type: ignore[arg-type]
    lease = buf.pull("a", "a-trainer-0", 1)
    assert lease is not None
    buf.pause("a")  # its trainer failed: it restarts alone
    buf.consumer_failed("a-trainer-0")  # what its lost rank leased is redelivered, not dropped
    buf.put(first[1], episode("e1", turn("a"), turn("b")))  # type: ignore[arg-type]
    late = buf.acquire(["a", "b"])  # b's episodes keep starting
    assert late is not None
    buf.put(late, episode("e2", turn("a"), turn("b")))
    a, b = buf.stats("a"), buf.stats("b")
    assert a.buffered == 1 and a.dropped[DropReason.POLICY_RESTARTING] == 2, a
    assert b.buffered == 3 and b.dropped[DropReason.POLICY_RESTARTING] == 0, b
    # it publishes past the version its engines served: credit from there, its end moved with it
    assert buf.restart("a", 2, 6) == 1  # its sample of version 0 is now too stale (sync)
    a = buf.stats("a")
    assert (a.version, a.buffered, a.credit) == (2, 0, 2) and buf.acquire(["a", "b"]) is not None
    assert a.produced == a.consumed + a.buffered + a.leased + sum(a.dropped.values())


def test_cancel_counts_everything_and_late_puts() -> None:
    buf = ExperienceBuffer([PolicyConfig("a", 5, 1)], 100)
    t1, t2 = buf.acquire(["a"]), buf.acquire(["a"])
    assert t1 is not None and t2 is not None
    buf.put(t1, episode("e1", turn("a"), turn("a")))
    assert buf.pull("a", "t", 1) is not None
    buf.cancel()
    buf.put(t2, episode("e2", turn("a")))  # a workflow finishing after the cancel
    s = buf.stats("a")
    assert s.dropped[DropReason.JOB_CANCELLED] == 3 and s.produced == 3
    assert buf.acquire(["a"]) is None and buf.pull("a", "t", 1) is None


def test_episode_pickles_exactly() -> None:
    import pickle

    ep = Episode(
        "e9",
        (turn("a", 3, n=4, agent="x"), Turn("y", "b", [], [5], [-2.5], [7]), turn("a", 4, n=1, agent="x")),
        {"x": 1.5, "y": -1.0},
        {"k": [1, 2]},
    )
    back = pickle.loads(pickle.dumps(ep))
    assert back.episode_id == ep.episode_id and dict(back.rewards) == dict(ep.rewards)
    assert dict(back.metadata) == {"k": [1, 2]}
    for a, b in zip(ep.turns, back.turns, strict=True):
        assert (a.agent, a.policy) == (b.agent, b.policy)
        for name in ("prompt_ids", "response_ids", "logprobs", "versions"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and np.array_equal(x, y), name


def test_episode_wire_format_is_bit_exact_and_one_buffer() -> None:
    import pickle

    odd = np.array([-0.0, np.nan, np.inf, -1e-45], dtype=np.float32)
    ep = Episode(
        "e7",
        (
            Turn(
                "x",
                "a",
                [1, 2],
                [3, 4, 5, 6],
                odd,
                [1, 1, 2, 2],
                allowed_ids=[3, 4, 5, 6, 9],
                temperature=0.6,
            ),
            Turn("y", "b", [], [8], [-1.0], [0]),
        ),
        {"x": 1.0, "y": 0.0},
    )
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(ep, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1  # Ray's per-buffer cost: one numpy buffer per episode on the wire
    back = pickle.loads(blob, buffers=buffers)
    for a, b in zip(ep.turns, back.turns, strict=True):
        for name in ("prompt_ids", "response_ids", "logprobs", "versions", "allowed_ids"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name
    assert [s.min_version for s in back.samples()] == [1, 0]
    assert back.policies == frozenset({"a", "b"})
    assert [t.temperature for t in back.turns] == [0.6, 1.0] == [s.temperature for s in back.samples()]


def test_put_many_is_all_or_none() -> None:
    buf = ExperienceBuffer([PolicyConfig("a", 10), PolicyConfig("b", 10)], 10)
    t1, t2 = buf.acquire_many(["a"], 2)
    with pytest.raises(UnknownTicketError):
        buf.put_many(
            [(t1, episode("e1", turn("a"))), (Ticket(999, frozenset({"a"})), episode("e2", turn("a")))]
        )
    with pytest.raises(UnknownTicketError):  # the same ticket twice in one batch
        buf.put_many([(t1, episode("e1", turn("a"))), (t1, episode("e2", turn("a")))])
    with pytest.raises(ValueError, match="without credit"):
        buf.put_many([(t1, episode("e1", turn("a"))), (t2, episode("e2", turn("a"), turn("b")))])
    assert buf.stats("a").produced == 0 and buf.resident_episodes == 2  # nothing taken, tickets kept
    buf.put_many([(t1, episode("e1", turn("a"))), (t2, episode("e2", turn("a")))])
    lease = buf.pull("a", "t", 10)
    assert lease is not None and lease.batch.sample_ids == ("e1/0", "e2/0")


def test_acquire_many_takes_what_credit_allows() -> None:
    buf = ExperienceBuffer([PolicyConfig("a", 3), PolicyConfig("b", 2)], 10)
    tickets = buf.acquire_many(["a", "b"], 5)
    assert len(tickets) == 2 and len({t.ticket_id for t in tickets}) == 2  # b's credit is 2
    assert buf.stats("a").credit == 1 and buf.stats("b").credit == 0
    assert buf.acquire_many(["a", "b"], 5) == [] and buf.acquire_many(["a"], 0) == []
    assert len(buf.acquire_many(["a"], 5)) == 1


def test_credit_stops_at_the_final_versions_episodes() -> None:
    """Async mode near the end: no episode is started that no step will train on, and a resumed job
    with more steps (a higher final version) gets the credit for them."""
    a = PolicyConfig("a", 2, 2, final_version=2)
    buf = ExperienceBuffer([a, PolicyConfig("b", 2, 2)], 100)
    tickets = buf.acquire_many(["a"], 10)
    assert len(tickets) == 4  # 2 versions x 2 episodes, not (0 + 2 + 1) x 2
    assert len(buf.acquire_many(["b"], 10)) == 6  # open-ended: the staleness bound only
    for i, t in enumerate(tickets):
        buf.put(t, episode(f"e{i}", turn("a")))
    buf.advance("a", 1)
    assert buf.stats("a").credit == 0 and not buf.acquire_many(["a"], 1)
    resumed = ExperienceBuffer.restore(buf.snapshot(), [replace(a, final_version=5), PolicyConfig("b", 2, 2)])
    assert resumed.stats("a").credit == 4  # (1 + 2 + 1) x 2, less the 4 episodes still buffered
    with pytest.raises(ValueError, match="final_version"):
        PolicyConfig("c", 2, final_version=0)


def test_a_finished_policy_reopened_after_restore_gets_its_credit_back() -> None:
    """Resume with more steps: a policy that finished with every ticket taken must be able to produce
    again. Before the fix its credit stayed frozen at zero (finished policies kept no accounts), so the
    resumed job waited forever for samples no producer could make."""
    buf = ExperienceBuffer([PolicyConfig("a", 2, 1)], 100)
    t0, t1 = buf.acquire(["a"]), buf.acquire(["a"])
    assert t0 is not None and t1 is not None
    buf.put(t0, episode("e0", turn("a")))
    lease = buf.pull("a", "t", 1)
    assert lease is not None
    buf.ack(lease.lease_id)  # e0 consumed: it holds its credit for good
    buf.put(t1, episode("e1", turn("a")))  # buffered, never trained
    buf.advance("a", 1)
    more = buf.acquire_many(["a"], 10)
    assert len(more) == 4 and buf.stats("a").credit == 0  # limit (1 + 1 + 1) * 2 = 6, e0 e1 hold 2
    buf.put(more[0], episode("e2", turn("a")))
    buf.finish("a")  # drops e1 and e2 (nothing consumed: their credit comes back)
    buf.put(more[1], episode("e3", turn("a")))  # arrives after the end: dropped, credit back
    assert buf.acquire(["a"]) is None  # no episode is started for a finished policy alone
    restored = ExperienceBuffer.restore(buf.snapshot())  # more[2:] die with the process
    restored.reopen("a")
    st_ = restored.stats("a")
    assert not st_.finished and st_.admitted == 1 and st_.credit == 5  # only e0 still holds credit
    assert len(restored.acquire_many(["a"], 10)) == 5
    with pytest.raises(KeyError, match="unknown policy"):
        restored.reopen("nope")


def test_restore_under_the_jobs_current_policies() -> None:
    """A resumed job may have changed: its staleness and episodes per step apply, a new policy starts
    empty, and a removed policy's samples are dropped and counted, not lost silently."""
    buf = ExperienceBuffer([PolicyConfig("a", 2, 2), PolicyConfig("gone", 2, 1)], 100)
    for i, v in enumerate([0, 2]):
        t = buf.acquire(["a", "gone"])
        assert t is not None
        buf.put(t, episode(f"e{i}", turn("a", v), turn("gone", v)))
    buf.advance("a", 2)
    assert buf.stats("a").buffered == 2  # lags 2 and 0 are within maxStaleness 2
    snap = buf.snapshot()
    restored = ExperienceBuffer.restore(snap, [PolicyConfig("a", 3, 0), PolicyConfig("new", 4, 1)], 50)
    a, gone, new = restored.stats("a"), restored.stats("gone"), restored.stats("new")
    assert a.buffered == 1 and a.dropped[DropReason.STALE] == 1  # lag 2 > the new maxStaleness 0
    assert a.credit == 3 - 1  # sync now: the version's new episodes per version, e1 one of them
    assert gone.finished and gone.buffered == 0 and gone.dropped[DropReason.POLICY_FINISHED] == 2
    assert new.buffered == 0 and new.credit == (0 + 1 + 1) * 4
    assert restored.capacity_episodes == 50
    same = ExperienceBuffer.restore(snap)  # without a job: the snapshot's own configuration
    assert same.stats("a").buffered == 2 and not same.stats("gone").finished
