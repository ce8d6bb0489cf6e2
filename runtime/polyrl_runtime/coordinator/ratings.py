"""Ratings of policy versions from the games they played (a league's episodes): the Bradley-Terry model
fitted by maximum likelihood, on the Elo scale (a rating 400 above another wins 10 to 1), as Chatbot
Arena rates models from battles, rather than Elo's online updates, whose result depends on the order
of the games.

Games come as (a, b, a's score summed over them, how many): a node is a policy and a version, and a
game scores 1, 0.5 (a draw: half a win each) or 0 for a. The fit is Hunter's minorise-maximise iteration (2004). One node is the anchor, fixed at
`anchor_rating`, so that ratings of one run are comparable over its steps: a league's version 0, the
initial weights, by default. Every node also plays one virtual draw against the anchor, a prior that
keeps a node that won (or lost) all its games at a finite rating and pulls a node with few games
toward the anchor.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping
from typing import TypeVar

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
