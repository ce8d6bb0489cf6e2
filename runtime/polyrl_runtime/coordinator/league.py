"""The job's leagues (`spec.policies[].league`): snapshots of each league policy's past versions on its
engines, and the tables the workflow workers draw opponents from (workflows/opponents.py).

After a league policy's weight sync of a version that is a multiple of `snapshotEverySteps` (version
0, the initial weights, included), every live engine of the policy takes a snapshot of it
(`Engine.snapshot`, at most `keep`). A snapshot is drawable once every live engine holds it: the
table lists the versions all of them report, so a request for one finds it on whichever engine the
pool picks. The tables follow the fleet (`refresh`, at every fleet poll): an engine holds what its
snapshot calls reported (only they change it), so an engine that joins holds none until it gets
copies of the snapshots the best-stocked live engine holds (`Engine.snapshot_state`, then
`load_snapshots`, at the next poll) or the next snapshot is taken; until then the draws leave out
what it lacks. An engine that dies no longer counts. An episode whose opponent's snapshot is gone
anyway (evicted meanwhile) is played again against another draw by its worker, counted as
`snapshot_replaced` (workflows/runner.py).

Results: each finished episode that played a snapshot scores the current version's agents against
it (1, 0.5, 0), accumulated per snapshot version; pfsp weighs the held snapshots by them
(AlphaStar's prioritised fictitious self-play: hard, (1 - x)^2 of the win rate x; variance,
x (1 - x)), 0.5 for a version not yet played. The same games go to the job's ratings (coordinator/
ratings.py `RatingBook`): an episode whose trained agents are of one policy is a game between that
policy's version (the oldest of its sampled tokens) and the snapshot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from polyrl_operator.api import League, RLJobSpec
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.ratings import RatingBook
from polyrl_runtime.engines.api import SnapshotReport
from polyrl_runtime.workflows.opponents import OpponentRecord, OpponentTable

log = structlog.get_logger(__name__)

PRIOR_WIN_RATE = 0.5  # a snapshot's win rate before any episode played it


def pfsp_weight(win_rate: float, weighting: str) -> float:
    """A snapshot's draw weight under pfsp, from the current version's win rate against it."""
    if weighting == "hard":
        return (1.0 - win_rate) ** 2
    if weighting == "variance":
        return win_rate * (1.0 - win_rate)
    raise ValueError(f"unknown pfspWeighting {weighting!r}")


@dataclass
class LeagueBook:
    """One league policy's snapshots and results."""

    policy: str
    cfg: League
    held: tuple[int, ...] = ()  # the versions every live engine of the policy holds
    nbytes: int = 0  # what the held snapshots occupy on one engine
    scores: dict[int, list[float]] = field(default_factory=dict)  # version -> [score sum, games]
    since_asked: int = 0  # finished episodes in a row that drew no opponent of the policy

    def due(self, version: int) -> bool:
        return version % self.cfg.snapshot_every_steps == 0

    def win_rate(self, version: int) -> float:
        total, games = self.scores.get(version, (0.0, 0.0))
        return total / games if games else PRIOR_WIN_RATE

    def weights(self) -> tuple[float, ...]:
        if self.cfg.sampling == "pfsp":
            return tuple(pfsp_weight(self.win_rate(v), self.cfg.pfsp_weighting) for v in self.held)
        return (1.0,) * len(self.held)

    def table(self) -> OpponentTable:
        if self.cfg.sampling == "latest":
            return OpponentTable(self.policy)
        return OpponentTable(self.policy, self.held, self.weights(), self.cfg.latest_fraction)

    def record(self, rec: OpponentRecord) -> None:
        """A game of the current version's agents against snapshot `rec.version`."""
        if rec.score is None:
            return
        total = self.scores.setdefault(rec.version, [0.0, 0.0])
        total[0] += rec.score
        total[1] += 1

    def progress(self) -> dict[str, Any]:
        """The policy's league figures of a step record (docs/local-run.md#metrics)."""
        return {
            "league_held": list(self.held),
            "league_bytes": self.nbytes,
            "league_win_rate": {str(v): round(self.win_rate(v), 4) for v in self.held},
            "league_games_total": {str(v): int(s[1]) for v, s in sorted(self.scores.items())},
        }


class Leagues:
    """Every league of the job; a job without one has none, and every call does nothing."""

    def __init__(
        self,
        spec: RLJobSpec,
        fleet: Fleet,
        fail: Callable[[str], None],
        unused_episodes: int,
        ratings: RatingBook,
    ) -> None:
        self.fleet, self._fail, self.unused_episodes = fleet, fail, unused_episodes
        self.ratings = ratings
        self.books = {p.name: LeagueBook(p.name, p.league) for p in spec.policies if p.league is not None}
        self.fields = {p.name: f"spec.policies[{i}].league" for i, p in enumerate(spec.policies)}
        self.entrypoint = spec.workflow.entrypoint
        # A league policy in a cross-play pair may meet no opponent: its snapshots play in cross-play.
        cp = spec.evaluation.cross_play if spec.evaluation is not None else None
        self.cross_played = {p for x in cp.pairs for p in (x.row, x.column)} if cp is not None else set()
        # engine -> policy -> the snapshot versions its latest snapshot call reported it holds
        self._reported: dict[str, dict[str, tuple[int, ...]]] = {}

    def _held(self, policy: str) -> tuple[int, ...]:
        """The snapshots of `policy` every one of its live engines holds."""
        sets = [set(self._reported.get(n, {}).get(policy, ())) for n in self.fleet.live_engines(policy)]
        return tuple(sorted(set.intersection(*sets))) if sets else ()

    def held(self, policy: str) -> tuple[int, ...]:
        """The drawable snapshots of `policy` (none without a league)."""
        book = self.books.get(policy)
        return book.held if book is not None else ()

    def tables(self) -> dict[str, OpponentTable]:
        return {name: book.table() for name, book in self.books.items()}

    async def after_sync(self, policy: str, version: int) -> None:
        """Snapshot `version` on the policy's live engines if it is due, then push the tables."""
        book = self.books.get(policy)
        if book is None or not book.due(version):
            return
        engines = self.fleet.live_engines(policy)
        results = await asyncio.gather(
            *(s.actor.snapshot(policy, book.cfg.keep) for s in engines.values()), return_exceptions=True
        )
        reports = [r for r in results if isinstance(r, SnapshotReport)]
        for name, r in zip(engines, results, strict=True):
            if isinstance(r, SnapshotReport):
                self._reported.setdefault(name, {})[policy] = r.held
            else:  # it holds what it held before; the draws leave out what it lacks
                log.warning(
                    "league.snapshot_failed", policy=policy, engine=name, version=version, error=str(r)
                )
        book.held = self._held(policy)
        book.nbytes = max((r.nbytes for r in reports), default=0)
        log.info("league.snapshot", policy=policy, version=version, held=list(book.held), nbytes=book.nbytes)
        await self.fleet.set_opponents(self.tables())

    async def refresh(self) -> None:
        """Each league's drawable snapshots, from what its live engines' snapshot calls reported (an
        engine joined or died since); an engine that lacks snapshots another live engine holds (it
        joined) gets copies of them first. The tables are pushed when they change."""
        changed = False
        for name, book in self.books.items():
            await self._copy_to_joined(name, book.cfg.keep)
            held = self._held(name)
            if held != book.held:
                log.info("league.held", policy=name, held=list(held), was=list(book.held))
                book.held, changed = held, True
        if changed:
            await self.fleet.set_opponents(self.tables())

    async def _copy_to_joined(self, policy: str, keep: int) -> None:
        """Copy the snapshots of `policy` that the best-stocked live engine holds onto each live engine
        that lacks some, newest first (a failure is logged: the draws leave out what it lacks)."""
        engines = self.fleet.live_engines(policy)
        reported = {n: set(self._reported.get(n, {}).get(policy, ())) for n in engines}
        if not reported:
            return
        donor = max(reported, key=lambda n: (len(reported[n]), max(reported[n], default=-1)))
        for name, have in reported.items():
            missing = sorted(reported[donor] - have)[-keep:]
            if name == donor or not missing:
                continue
            try:
                states = await engines[donor].actor.snapshot_state(policy, missing)
                report = await engines[name].actor.load_snapshots(policy, states, keep)
            except Exception as e:
                log.warning("league.copy_failed", policy=policy, engine=name, source=donor, error=str(e))
                continue
            self._reported.setdefault(name, {})[policy] = report.held
            log.info(
                "league.copied",
                policy=policy,
                engine=name,
                source=donor,
                versions=missing,
                held=list(report.held),
            )

    def episode(
        self, asked: frozenset[str], opponents: Mapping[str, OpponentRecord], versions: Mapping[str, int]
    ) -> None:
        """A finished episode: the league policies `ctx.opponent` was asked for, the snapshots its
        opponents played, and its version vector (the trained policies' versions). A league whose
        policy no episode asks an opponent of, `unused_episodes` in a row, fails the job naming the
        field: its snapshots would never play (unless the policy is in a cross-play pair)."""
        trained = next(iter(versions.items())) if len(versions) == 1 else None
        for rec in opponents.values():
            if rec.policy in self.books:
                self.books[rec.policy].record(rec)
                if trained is not None and rec.score is not None:  # one trained policy: a rated game
                    self.ratings.add(trained, (rec.policy, rec.version), rec.score)
        for name, book in self.books.items():
            book.since_asked = 0 if name in asked else book.since_asked + 1
            if book.since_asked == self.unused_episodes and name not in self.cross_played:
                self._fail(
                    f"{self.fields[name]}: workflow {self.entrypoint} asked for no opponent of policy "
                    f"{name} (ctx.opponent) in {book.since_asked} episodes in a row: its league's "
                    f"snapshots would never play (call ctx.opponent, or remove the league)"
                )

    def progress(self, policy: str) -> dict[str, Any]:
        book = self.books.get(policy)
        return book.progress() if book is not None else {}
