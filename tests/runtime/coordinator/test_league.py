"""The driver's league books (coordinator/league.py), pure: which versions are snapshotted, the draw
weights of each sampling (pfsp against the published weightings), the tables the workers get, and
the results an episode adds."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from polyrl_operator.api import League, RLJob
from polyrl_runtime.coordinator.league import PRIOR_WIN_RATE, LeagueBook, Leagues, pfsp_weight
from polyrl_runtime.coordinator.ratings import RatingBook
from polyrl_runtime.engines.api import SnapshotReport
from polyrl_runtime.workflows.opponents import OpponentRecord, OpponentTable
from polyrl_testenv.bad_rljobs import base_job


def _book(**cfg: object) -> LeagueBook:
    return LeagueBook("agent", League.model_validate(cfg), held=(0, 2, 4))


def test_every_nth_version_is_due_the_initial_one_included() -> None:
    book = _book(snapshotEverySteps=2)
    assert [v for v in range(7) if book.due(v)] == [0, 2, 4, 6]


@pytest.mark.parametrize(
    ("weighting", "x", "want"), [("hard", 0.25, 0.5625), ("hard", 1.0, 0.0), ("variance", 0.25, 0.1875)]
)
def test_pfsp_weights_are_alphastars(weighting: str, x: float, want: float) -> None:
    assert pfsp_weight(x, weighting) == pytest.approx(want)


def test_pfsp_weighs_the_held_snapshots_by_the_results_against_them() -> None:
    book = _book(sampling="pfsp", latestFraction=0.3)
    for score in (1.0, 1.0, 0.0, 1.0):  # 0.75 against version 0
        book.record(OpponentRecord("agent", 0, score))
    book.record(OpponentRecord("agent", 2, 0.0))
    book.record(OpponentRecord("agent", 2, None))  # no comparable rewards: not a game
    assert book.win_rate(0) == 0.75 and book.win_rate(2) == 0.0 and book.win_rate(4) == PRIOR_WIN_RATE
    table = book.table()
    assert table.held == (0, 2, 4) and table.latest_fraction == 0.3
    assert table.weights == pytest.approx((0.0625, 1.0, 0.25))
    assert book.progress()["league_games_total"] == {"0": 4, "2": 1}


def test_uniform_and_latest_tables() -> None:
    assert _book(sampling="uniform").table().weights == (1.0, 1.0, 1.0)
    assert _book(sampling="latest").table() == OpponentTable("agent")  # never a snapshot


def test_the_leagues_rate_the_versions_from_their_games_against_snapshots() -> None:
    spec = RLJob.model_validate(base_job()).spec
    spec.policies[0].league = League()
    name = spec.policies[0].name
    ratings = RatingBook([p.name for p in spec.policies])
    leagues = Leagues(spec, _Fleet(), lambda m: None, 100, ratings)  # type: ignore[arg-type]
    asked = frozenset({name})
    for score in (1.0, 1.0, 1.0, 0.0):
        leagues.episode(asked, {"p1": OpponentRecord(name, 0, score)}, {name: 3})
    leagues.episode(asked, {"p1": OpponentRecord(name, 3, 1.0)}, {name: 3})  # itself: not a rated game
    # several trained policies: counted for pfsp, not rated
    leagues.episode(asked, {"p1": OpponentRecord(name, 2, 1.0)}, {name: 3, "other": 1})
    progress = ratings.progress(name)
    assert progress["rated_version"] == 3
    # 3 of 4 against the anchor, plus the prior's draw: 400 log10(3.5 / 1.5) above it.
    assert progress["rating"] == pytest.approx(1000 + 147.2, abs=0.1)
    assert leagues.books[name].progress()["league_games_total"] == {"0": 4, "2": 1, "3": 1}


class _Engine:
    """An engine actor's client whose `snapshot` holds the last `keep` versions it was asked for."""

    def __init__(self, broken: bool = False) -> None:
        self.held: list[int] = []
        self.broken = broken

    async def snapshot(self, policy: str, keep: int) -> SnapshotReport:
        self.held = [*self.held, len(self.held) * 2][-keep:]  # versions 0, 2, 4, ...
        return SnapshotReport(policy, self.held[-1], (), tuple(self.held), 100 * len(self.held))

    async def snapshot_state(self, policy: str, versions: list[int]) -> dict[int, dict[str, Any]]:
        assert set(versions) <= set(self.held)
        return {v: {"w": v} for v in versions}

    async def load_snapshots(self, policy: str, states: dict[int, Any], keep: int) -> SnapshotReport:
        if self.broken:
            raise RuntimeError("out of memory")
        self.held = sorted({*self.held, *states})[-keep:]
        return SnapshotReport(policy, self.held[-1], (), tuple(self.held), 100 * len(self.held))


class _Fleet:
    def __init__(self) -> None:
        self.engines: dict[str, Any] = {}
        self.pushed: list[dict[str, OpponentTable]] = []

    def live_engines(self, policy: str) -> dict[str, Any]:
        return dict(self.engines)

    async def set_opponents(self, tables: dict[str, OpponentTable]) -> None:
        self.pushed.append(tables)


def test_the_draws_follow_the_fleet_an_engine_that_joins_gets_copies_of_the_snapshots() -> None:
    spec = RLJob.model_validate(base_job()).spec
    spec.policies[0].league = League(snapshotEverySteps=2, keep=2)
    fleet = _Fleet()
    fleet.engines["e1"] = SimpleNamespace(actor=_Engine())
    ratings = RatingBook([p.name for p in spec.policies])
    leagues = Leagues(spec, fleet, lambda m: None, 100, ratings)  # type: ignore[arg-type]
    name = spec.policies[0].name

    async def go() -> None:
        await leagues.after_sync(name, 0)
        await leagues.after_sync(name, 1)  # not due
        await leagues.after_sync(name, 2)
        assert leagues.books[name].held == (0, 2) and fleet.pushed[-1][name].held == (0, 2)
        fleet.engines["e2"] = SimpleNamespace(actor=_Engine())  # joins with no snapshot
        pushes = len(fleet.pushed)
        await leagues.refresh()  # it gets copies of e1's: the draws go on over both
        assert fleet.engines["e2"].actor.held == [0, 2] and leagues.books[name].held == (0, 2)
        assert len(fleet.pushed) == pushes  # nothing changed: nothing pushed
        fleet.engines["e3"] = SimpleNamespace(actor=_Engine(broken=True))  # cannot take them
        await leagues.refresh()
        assert leagues.books[name].held == () and fleet.pushed[-1][name].held == ()  # the latest only
        del fleet.engines["e3"]  # dies
        await leagues.refresh()
        assert leagues.books[name].held == (0, 2)

    asyncio.run(go())
