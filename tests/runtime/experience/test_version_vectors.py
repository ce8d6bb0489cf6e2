"""Version vectors: every sample records the version of each policy of its episode, through every
path a sample takes (an episode's samples, the wire, a lease, a snapshot), and the buffer drops an
episode whose policies are further apart than the job's bound."""

from __future__ import annotations

import pickle

import pytest

from polyrl_runtime.experience import DropReason, Episode, ExperienceBuffer, PolicyConfig, Turn
from polyrl_runtime.experience.types import CONTEXT, version_skew, version_vector


def turn(policy: str, *versions: int, agent: str | None = None) -> Turn:
    logprobs = [0.0 if v == CONTEXT else -0.1 for v in versions]
    return Turn(agent or policy, policy, [7, 8], list(range(len(versions))), logprobs, list(versions))


def episode(eid: str, *turns: Turn) -> Episode:
    return Episode(eid, turns, {t.agent: 0.5 for t in turns})


def test_an_episodes_vector_holds_each_policys_oldest_sampled_version() -> None:
    ep = episode(
        "e",
        turn("a", 5, 6, agent="a1"),
        turn("b", CONTEXT, 3, 4),  # a context token has no version
        turn("a", 4, agent="a2"),
    )
    assert ep.versions == {"a": 4, "b": 3}
    assert version_skew(ep.versions) == 1 and version_skew({"a": 9}) == 0
    assert version_vector([("a", 2), ("b", 7), ("a", 1)]) == {"a": 1, "b": 7}
    assert [s.episode_versions for s in ep.samples()] == [{"a": 4, "b": 3}] * 3


@pytest.mark.parametrize("path", ["samples", "wire", "snapshot"])
def test_every_sample_a_trainer_leases_carries_its_episodes_vector(path: str) -> None:
    buf = ExperienceBuffer(
        [PolicyConfig("a", 4, max_staleness=8), PolicyConfig("b", 4, max_staleness=8)], 100
    )
    episodes = [episode("e0", turn("a", 2), turn("b", 0)), episode("e1", turn("b", 1), turn("a", 3, 3))]
    items = [(buf.acquire(["a", "b"]), e) for e in episodes]
    assert all(t is not None for t, _ in items)
    buf.put_many([(t, e) for t, e in items if t is not None])
    if path == "snapshot":
        buf = ExperienceBuffer.restore(pickle.loads(pickle.dumps(buf.snapshot())))
    lease = buf.pull("b", "trainer", 8)
    assert lease is not None
    batch = pickle.loads(pickle.dumps(lease.batch)) if path == "wire" else lease.batch
    assert batch.episode_versions == {"e0": {"a": 2, "b": 0}, "e1": {"a": 3, "b": 1}}
    assert [s.episode_versions for s in batch.samples()] == [{"a": 2, "b": 0}, {"a": 3, "b": 1}]


def test_an_episode_over_the_bound_is_dropped_for_every_policy_and_its_credit_comes_back() -> None:
    configs = [PolicyConfig(n, 4, max_staleness=8, max_version_skew=1) for n in ("a", "b")]
    buf = ExperienceBuffer(configs, 100)
    tickets = [buf.acquire(["a", "b"]) for _ in range(3)]
    credit = buf.stats("a").credit
    near = episode("near", turn("a", 5), turn("b", 4))  # one apart: kept
    far = episode("far", turn("a", 6, 7), turn("b", 4), turn("a", 7))  # two apart: dropped
    alone = episode("alone", turn("a", 0))  # a single policy has no skew
    buf.put_many([(t, e) for t, e in zip(tickets, (near, far, alone), strict=True) if t is not None])
    a, b = buf.stats("a"), buf.stats("b")
    assert a.dropped[DropReason.VERSION_SKEW] == 2 and b.dropped[DropReason.VERSION_SKEW] == 1
    assert a.buffered == 2 and b.buffered == 1 and a.produced == 4 and b.produced == 2
    assert a.credit == credit + 1 and b.credit == credit + 2  # "far" gave back; "alone" never used b
    lease = buf.pull("a", "trainer", 8)
    assert lease is not None and lease.batch.episode_ids == ("near", "alone")


def test_a_finished_policy_does_not_hold_the_others_to_its_version() -> None:
    # A policy that has finished stays at its last version: the others still train on episodes with it.
    configs = [PolicyConfig(n, 4, max_staleness=8, max_version_skew=0) for n in ("a", "b")]
    buf = ExperienceBuffer(configs, 100)
    t1, t2 = buf.acquire(["a", "b"]), buf.acquire(["a", "b"])
    assert t1 is not None and t2 is not None
    buf.put(t1, episode("e1", turn("a", 9), turn("b", 3)))
    assert buf.stats("b").dropped[DropReason.VERSION_SKEW] == 1
    buf.finish("a")
    buf.put(t2, episode("e2", turn("a", 9), turn("b", 3)))
    assert buf.stats("b").buffered == 1 and buf.stats("b").dropped[DropReason.VERSION_SKEW] == 1


def test_the_bound_is_checked() -> None:
    with pytest.raises(ValueError, match="max_version_skew >= 0"):
        PolicyConfig("a", 4, max_version_skew=-1)
