"""The train data feed: order, shuffle by seed, epochs, rows given back, and the checkpointed position
(a resumed feed neither repeats nor skips a row)."""

from __future__ import annotations

import pytest

from polyrl_runtime.coordinator.datafeed import DataFeed

ROWS = [{"id": i} for i in range(5)]


def feed(*, seed: int = 0, shuffle: bool = True, epochs: int | None = None, n: int = 5) -> DataFeed:
    return DataFeed(
        "file:///d.jsonl", [{"id": i} for i in range(n)], seed=seed, shuffle=shuffle, epochs=epochs
    )


def play(f: DataFeed, groups: int, start: int = 0) -> list[int]:
    """Dispatch and settle `groups` groups one by one; the row ids played."""
    out = []
    for g in range(start, start + groups):
        ref = f.take(f"g{g}")
        if ref is None:
            break
        out.append(ref.index)
        f.settle(f"g{g}")
    return out


@pytest.mark.parametrize(
    ("shuffle", "seed", "epochs", "groups", "check"),
    [
        (False, 0, None, 7, lambda ids: ids == [0, 1, 2, 3, 4, 0, 1]),
        (
            True,
            0,
            2,
            20,
            lambda ids: len(ids) == 10 and sorted(ids[:5]) == sorted(ids[5:]) == [0, 1, 2, 3, 4],
        ),
        (True, 3, 1, 9, lambda ids: sorted(ids) == [0, 1, 2, 3, 4]),
        (True, 0, 3, 100, lambda ids: ids[:5] != ids[5:10] or ids[5:10] != ids[10:]),  # epochs reshuffle
    ],
)
def test_order_and_epochs(shuffle: bool, seed: int, epochs: int | None, groups: int, check: object) -> None:
    ids = play(feed(shuffle=shuffle, seed=seed, epochs=epochs), groups)
    assert callable(check) and check(ids), ids


def test_shuffle_is_determined_by_the_seed() -> None:
    a, b, c = (play(feed(seed=s, n=50), 50) for s in (1, 1, 2))
    assert a == b and a != c and a != list(range(50))


def test_exhausted_and_finished() -> None:
    f = feed(epochs=1, n=2)
    f.take("g0"), f.take("g1")
    assert f.exhausted and not f.finished and f.take("g2") is None
    f.settle("g0"), f.settle("g1")
    assert f.finished


def test_a_group_that_never_ran_gives_its_row_back() -> None:
    f = feed(shuffle=False, epochs=1)
    assert [f.take(g).index for g in ("g0", "g1")] == [0, 1]  # type: ignore[union-attr]
    f.give_back("g0")
    assert f.take("g2").index == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("buffered", [set(), {"g4"}, {"g4", "g5"}])
def test_resume_neither_repeats_nor_skips(buffered: set[str]) -> None:
    """Groups in flight at the checkpoint replay after resume, except those whose samples are in the
    checkpoint's buffer (they are trained from it)."""
    n, epochs = 7, 2
    whole = play(feed(n=n, epochs=epochs), 100)
    first = feed(n=n, epochs=epochs)
    played = play(first, 4)
    in_flight = [first.take(g) for g in ("g4", "g5")]  # dispatched, results not back at the checkpoint
    state = first.state()
    resumed = feed(n=n, epochs=epochs)
    resumed.restore(state, buffered)
    from_buffer = [r.index for g, r in zip(("g4", "g5"), in_flight, strict=True) if r and g in buffered]
    rest = play(resumed, 100, start=6)
    assert played + from_buffer + rest == whole


def test_other_data_starts_over() -> None:
    f = feed(n=5)
    play(f, 3)
    other = feed(n=6)
    other.restore(f.state())
    assert (other.epoch, other.offset) == (0, 0)
