"""Ratings of policy versions from the games they played (a league's episodes, cross-play passes): the
Bradley-Terry model
fitted by maximum likelihood, on the Elo scale (a rating 400 above another wins 10 to 1), as Chatbot
Arena rates models from battles, rather than Elo's online updates, whose result depends on the order
of the games.

Games come as (a, b, a's score summed over them, how many): a node is a policy and a version, and a
game scores 1, 0.5 (a draw: half a win each) or 0 for a. The fit is Hunter's minorise-maximise iteration (2004). One node is the anchor, fixed at
`anchor_rating`, so that ratings of one run are comparable over its steps: a league's version 0, the
initial weights, by default. Every node also plays one virtual draw against the anchor, a prior that
keeps a node that won (or lost) all its games at a finite rating and pulls a node with few games
toward the anchor.

`RatingBook` keeps a job's games and rates them by group: policies that played each other (a league
policy and its own snapshots; the two policies of a cross-play pair) form one group, fitted
together, anchored at `evaluation.crossPlay.anchor` (a frozen policy's version) where it is in the
group, else at version 0 of the group's first policy in spec.policies.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from polyrl_operator.api import RLJobSpec

Node = TypeVar("Node", bound=Hashable)

ANCHOR_RATING = 1000.0
_SCALE = 400.0 / math.log(10.0)  # Elo points per unit of log-strength


def bradley_terry(
    games: Iterable[tuple[Node, Node, float, float]],
    anchor: Node,
    *,
    anchor_rating: float = ANCHOR_RATING,
    iterations: int = 500,
    tolerance: float = 1e-9,
) -> dict[Node, float]:
    """Each node's rating (the anchor's is `anchor_rating`) from `games`: (a, b, a's total score, games)."""
    wins: dict[Node, float] = defaultdict(float)
    pairs: dict[tuple[Node, Node], float] = defaultdict(float)  # games between a and b, both orders

    def play(a: Node, b: Node, score: float, n: float) -> None:
        if not (n > 0 and 0.0 <= score <= n):
            raise ValueError(f"{a!r} against {b!r}: a score of {score} in {n} games is not in [0, games]")
        wins[a] += score
        wins[b] += n - score
        pairs[(a, b)] += n
        pairs[(b, a)] += n

    nodes: set[Node] = {anchor}
    for a, b, score, count in games:
        if a == b:
            continue  # a version against itself tells nothing about its rating
        play(a, b, score, count)
        nodes.update((a, b))
    for node in nodes - {anchor}:
        play(node, anchor, 0.5, 1.0)  # the prior
    opponents: dict[Node, list[Node]] = defaultdict(list)
    for a, b in pairs:
        opponents[a].append(b)
    strength = dict.fromkeys(nodes, 1.0)
    for _ in range(iterations):
        moved = 0.0
        for node in nodes:
            if node == anchor:
                continue
            denominator = sum(pairs[(node, o)] / (strength[node] + strength[o]) for o in opponents[node])
            new = max(wins[node], 1e-12) / denominator
            moved = max(moved, abs(math.log(new / strength[node])))
            strength[node] = new
        if moved < tolerance:
            break
    base = math.log(strength[anchor])
    return {node: anchor_rating + _SCALE * (math.log(g) - base) for node, g in strength.items()}


def win_probability(rating: float, other: float) -> float:
    """The chance a node rated `rating` beats one rated `other` (the model the ratings are fitted by)."""
    return 1.0 / (1.0 + math.pow(10.0, (other - rating) / 400.0))


def ratings_by_version(ratings: Mapping[tuple[str, int], float], policy: str) -> dict[int, float]:
    """One policy's ratings, by version."""
    return {v: r for (p, v), r in sorted(ratings.items()) if p == policy}


Version = tuple[str, int]  # a policy and one of its versions


class RatingBook:
    """A job's games between policy versions, and their ratings by group (module docstring)."""

    def __init__(
        self, policies: Sequence[str], anchor: str | None = None, anchor_rating: float = ANCHOR_RATING
    ) -> None:
        self.order = {p: i for i, p in enumerate(policies)}
        self.anchor, self.anchor_rating = anchor, anchor_rating
        self.games: dict[tuple[Version, Version], list[float]] = {}  # (a, b) -> [a's score, games]

    def add(self, a: Version, b: Version, score: float, games: float = 1.0) -> None:
        """`games` games of `a` against `b` in which `a` scored `score` in all (1 a win, 0.5 a draw)."""
        if a == b:
            return  # a version against itself tells nothing about its rating
        total = self.games.setdefault((a, b), [0.0, 0.0])
        total[0] += score
        total[1] += games

    def state(self) -> list[list[Any]]:
        """The games, as a checkpoint keeps them (JSON): [a's policy, version, b's policy, version,
        a's score, games] each, so that a resumed job rates the whole run."""
        return [[*a, *b, score, n] for (a, b), (score, n) in sorted(self.games.items())]

    def restore(self, state: Sequence[Sequence[Any]]) -> None:
        self.games = {
            ((str(pa), int(va)), (str(pb), int(vb))): [float(score), float(n)]
            for pa, va, pb, vb, score, n in state
        }

    def _groups(self) -> list[set[str]]:
        parent = {p: p for (a, b) in self.games for p in (a[0], b[0])}

        def root(p: str) -> str:
            while parent[p] != p:
                p = parent[p]
            return p

        for a, b in self.games:
            parent[root(a[0])] = root(b[0])
        groups: dict[str, set[str]] = {}
        for p in parent:
            groups.setdefault(root(p), set()).add(p)
        return list(groups.values())

    def ratings(self) -> dict[Version, float]:
        """Every version that played a game, rated within its group."""
        out: dict[Version, float] = {}
        for group in self._groups():
            games = [(a, b, s, n) for (a, b), (s, n) in self.games.items() if a[0] in group]
            if self.anchor in group:
                anchor, rating = (self.anchor, 0), self.anchor_rating
            else:
                anchor, rating = (
                    (min(group, key=lambda p: self.order.get(p, len(self.order))), 0),
                    ANCHOR_RATING,
                )
            out.update(bradley_terry(games, anchor, anchor_rating=rating))
        return out

    def newest(self, policy: str) -> tuple[int, float] | None:
        """The policy's newest version that played a game, and its rating (None before any game)."""
        played = [v for (a, b) in self.games for (p, v) in (a, b) if p == policy]
        if not played:
            return None
        version = max(played)
        return version, self.ratings()[(policy, version)]

    def progress(self, policy: str) -> dict[str, Any]:
        """The policy's rating figures of a step record (docs/local-run.md#metrics)."""
        newest = self.newest(policy)
        return {
            "rating": round(newest[1], 1) if newest else None,
            "rated_version": newest[0] if newest else None,
        }


def job_ratings(spec: RLJobSpec) -> RatingBook:
    """The job's rating book, anchored as `spec.evaluation.crossPlay` says."""
    cp = spec.evaluation.cross_play if spec.evaluation is not None else None
    return RatingBook(
        [p.name for p in spec.policies],
        anchor=cp.anchor if cp is not None else None,
        anchor_rating=cp.anchor_rating if cp is not None else ANCHOR_RATING,
    )
