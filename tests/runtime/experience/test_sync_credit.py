"""Sync-mode credit: a version admits episodesPerStep episodes on top of the earlier versions', the
credit failed episodes give back is granted again as a whole group, one version's replacements never
shorten the next, and a checkpoint keeps where the version stands."""

from __future__ import annotations

import pickle
import threading

from polyrl_runtime.experience import DropReason, Episode, ExperienceBuffer, PolicyConfig, Ticket, Turn

E, G = 4, 2  # episodes per version, episodes per group


def turn(policy: str, version: int = 0) -> Turn:
    return Turn(policy, policy, [7, 8], [1, 2, 3], [-0.1] * 3, [version] * 3)


def put(buf: ExperienceBuffer, tickets: list[Ticket], version: int = 0, name: str = "e") -> None:
    buf.put_many([(t, Episode(f"{name}{t.ticket_id}", (turn("a", version),), {"a": 0.5})) for t in tickets])


def train(buf: ExperienceBuffer, version: int) -> int:
    """One sync step: lease everything buffered, acknowledge it, advance. Returns the samples."""
    lease = buf.pull("a", "trainer", 1000)
    assert lease is not None
    buf.ack(lease.lease_id)
    buf.advance("a", version)
    return len(lease.batch)


def sync(final: int | None = None) -> ExperienceBuffer:
    return ExperienceBuffer([PolicyConfig("a", E, 0, final_version=final)], 100)


def test_failed_episodes_are_replaced_by_a_whole_group_within_the_version() -> None:
    buf = sync()
    first = buf.acquire_many(["a"], 100, group=G)
    assert len(first) == E
    put(buf, first[:3])
    buf.release(first[3])  # a failed episode: one episode's credit back, less than a group
    assert buf.stats("a").credit == 1
    again = buf.acquire_many(["a"], 100, group=G)
    assert len(again) == G  # granted as a whole group, one over the version's count
    assert buf.acquire_many(["a"], 100, group=G) == []
    assert buf.stats("a").pending == G
    put(buf, again)
    st = buf.stats("a")
    assert st.pending == 0 and st.credit == -1 and st.buffered == E + 1
    assert train(buf, 1) == E + 1  # the step has its full count (and the one over), none stale
    assert buf.stats("a").dropped[DropReason.STALE] == 0


def test_a_versions_replacements_do_not_shorten_the_next_version() -> None:
    buf = sync()
    first = buf.acquire_many(["a"], 100, group=G)
    put(buf, first[:3])
    buf.release(first[3])
    put(buf, buf.acquire_many(["a"], 100, group=G))
    train(buf, 1)
    assert buf.stats("a").credit == E
    assert len(buf.acquire_many(["a"], 100, group=G)) == E


def test_async_credit_below_a_group_waits_for_more() -> None:
    buf = ExperienceBuffer([PolicyConfig("a", E, 1)], 100)
    tickets = buf.acquire_many(["a"], 100, group=G)
    assert len(tickets) == 2 * E  # this version and the next
    buf.release(tickets[0])
    assert buf.acquire_many(["a"], 100, group=G) == []  # one episode's credit: not a group


def test_no_credit_once_the_final_version_is_reached() -> None:
    buf = sync(final=1)
    put(buf, buf.acquire_many(["a"], 100, group=G))
    train(buf, 1)
    assert buf.stats("a").credit == 0 and buf.acquire_many(["a"], 100, group=G) == []


def test_episodes_started_before_a_version_change_count_for_the_new_one() -> None:
    # They arrive stale and are dropped: the credit they give back completes the new version.
    buf = ExperienceBuffer([PolicyConfig("a", 2, 0)], 100)
    old = buf.acquire_many(["a"], 2)
    put(buf, old[:1])
    train(buf, 1)
    assert len(buf.acquire_many(["a"], 100)) == 1
    put(buf, old[1:])
    assert buf.stats("a").dropped[DropReason.STALE] == 1
    assert len(buf.acquire_many(["a"], 100)) == 1
    assert buf.stats("a").credit == 0


def test_wait_version_in_answers_when_every_episode_of_the_version_is_in() -> None:
    buf = sync()
    tickets = buf.acquire_many(["a"], 100, group=G)
    put(buf, tickets[:3])
    assert not buf.wait_version_in("a", timeout=0.01)  # one still under way
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(buf.wait_version_in("a", timeout=30)))
    waiter.start()
    put(buf, tickets[3:])
    waiter.join(timeout=10)
    assert woke == [True]
    train(buf, 1)
    assert not buf.wait_version_in("a", timeout=0)  # nothing buffered at the new version


def test_a_checkpoint_keeps_where_the_version_stands() -> None:
    buf = sync()
    first = buf.acquire_many(["a"], 100, group=G)
    put(buf, first[:3])
    buf.release(first[3])
    put(buf, buf.acquire_many(["a"], 100, group=G))
    train(buf, 1)
    put(buf, buf.acquire_many(["a"], 2, group=G), version=1, name="v1-")
    out = buf.acquire_many(["a"], 100, group=G)  # under way when the checkpoint is taken
    assert len(out) == 2
    resumed = ExperienceBuffer.restore(pickle.loads(pickle.dumps(buf.snapshot())))
    # The tickets died with the old process: their credit came back, and nothing else changed.
    assert resumed.stats("a").credit == 2 and resumed.stats("a").buffered == 2
    assert len(resumed.acquire_many(["a"], 100, group=G)) == 2
    # A checkpoint without the base (an older one): recomputed from what is buffered.
    snap = buf.snapshot()
    del snap.policies["a"]["base"]
    assert ExperienceBuffer.restore(snap).stats("a").credit == 2


def test_an_async_checkpoint_resumed_in_sync_mode_gives_the_version_its_count() -> None:
    buf = ExperienceBuffer([PolicyConfig("a", E, 1)], 100)
    tickets = buf.acquire_many(["a"], 100, group=G)
    put(buf, tickets[:E])  # version 0's episodes
    lease = buf.pull("a", "trainer", 1000)
    assert lease is not None
    buf.ack(lease.lease_id)
    buf.advance("a", 1)
    put(buf, tickets[E:], version=1, name="v1-")  # generated ahead at version 1, kept in sync mode
    resumed = ExperienceBuffer.restore(buf.snapshot(), [PolicyConfig("a", E, 0)])
    st = resumed.stats("a")
    assert st.buffered == E and st.credit == 0  # the version's episodes are all there
