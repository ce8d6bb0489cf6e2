"""Rows the workflow worker marks for the buffer to drop (Episode.metadata[FILTERED_KEY]): overlong
turns always, equal-reward groups (dynamic sampling) while the version's cap allows. Each is a
counted drop whose credit comes back, so that another episode takes its place."""

from __future__ import annotations

from typing import Any

from polyrl_runtime.experience import DropReason, Episode, ExperienceBuffer, PolicyConfig, Turn
from polyrl_runtime.experience.state import FILTERED_KEY

EPISODES = 4  # per version


def _turn(agent: str, policy: str = "p") -> Turn:
    return Turn(agent, policy, [7, 8], [1, 2, 3], [-0.1] * 3, [0] * 3)


def _episode(
    eid: str, marks: dict[str, list[int]] | None = None, agents: tuple[str, ...] = ("a",)
) -> Episode:
    meta: dict[str, Any] = {"seed": 1}
    if marks:
        meta[FILTERED_KEY] = marks
    return Episode(eid, tuple(_turn(a) for a in agents), dict.fromkeys(agents, 0.0), meta)


def _put(buf: ExperienceBuffer, *episodes: Episode) -> None:
    tickets = buf.acquire_many(["p"], len(episodes))
    assert len(tickets) == len(episodes)
    buf.put_many(list(zip(tickets, episodes, strict=True)))


def _buffer(cap: int | None) -> ExperienceBuffer:
    return ExperienceBuffer([PolicyConfig("p", EPISODES, 0, zero_variance_cap=cap)], capacity_episodes=64)


def test_marked_turns_are_dropped_by_reason_and_their_credit_comes_back() -> None:
    buf = _buffer(cap=8)
    _put(buf, _episode("e0", {"zero_variance": [0]}), _episode("e1", {"overlong": [0]}), _episode("e2"))
    s = buf.stats("p")
    assert s.buffered == 1 and s.dropped["zero_variance"] == 1 and s.dropped["overlong"] == 1
    # Two of the version's four episodes were dropped: three more may start (one is buffered).
    assert s.credit == EPISODES - 1


def test_an_overlong_turn_is_dropped_and_the_episodes_other_turns_kept() -> None:
    buf = _buffer(cap=None)
    _put(buf, _episode("e0", {"overlong": [1]}, agents=("a", "b", "c")))
    s = buf.stats("p")
    assert s.buffered == 2 and s.dropped["overlong"] == 1 and s.credit == EPISODES - 1
    lease = buf.pull("p", "t", 8)
    assert lease is not None
    assert [x.sample_id for x in lease.batch.samples()] == ["e0/0", "e0/2"]


def test_equal_reward_groups_are_kept_without_a_cap_and_past_it() -> None:
    off = _buffer(cap=None)
    _put(off, *(_episode(f"e{i}", {"zero_variance": [0]}) for i in range(2)))
    assert off.stats("p").buffered == 2 and off.stats("p").dropped["zero_variance"] == 0

    buf = _buffer(cap=2)
    _put(buf, *(_episode(f"a{i}", {"zero_variance": [0]}) for i in range(2)))  # within the cap
    _put(buf, *(_episode(f"b{i}", {"zero_variance": [0]}) for i in range(2)))  # past it: kept
    s = buf.stats("p")
    assert s.dropped["zero_variance"] == 2 and s.buffered == 2
    # A new version may drop as many again.
    lease = buf.pull("p", "t", 8)
    assert lease is not None
    buf.ack(lease.lease_id)
    buf.advance("p", 1)
    _put(buf, *(_episode(f"c{i}", {"zero_variance": [0]}) for i in range(2)))
    assert buf.stats("p").dropped["zero_variance"] == 4 and buf.stats("p").buffered == 0


def test_a_put_past_the_cap_is_kept_whole() -> None:
    buf = _buffer(cap=3)
    _put(buf, *(_episode(f"a{i}", {"zero_variance": [0]}) for i in range(2)))
    _put(buf, *(_episode(f"b{i}", {"zero_variance": [0]}) for i in range(2)))  # 2 + 2 > 3
    s = buf.stats("p")
    assert s.dropped["zero_variance"] == 2 and s.buffered == 2


def test_a_drop_reason_is_counted_from_the_start() -> None:
    s = _buffer(cap=1).stats("p")
    assert s.dropped[DropReason.ZERO_VARIANCE] == 0 and s.dropped[DropReason.OVERLONG] == 0
