"""A league's opponents in the workflow worker (`spec.policies[].league`): which version of a policy an
episode group plays against, and how a finished episode scored against it.

The driver pushes one `OpponentTable` per league policy (coordinator/league.py): the snapshot
versions every live engine of the policy holds, each one's draw weight, and the share of groups that
meet the latest version instead. `ctx.opponent(agent)` draws from it once per group and agent (every
episode of a group meets the same opponent, so their rewards stay comparable), by a hash of the group
id: the draw is the same whichever worker plays the group.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class OpponentTable:
    """How to draw an opponent of `policy`: `held[i]` with weight `weights[i]`, or the latest version
    in a `latest_fraction` of the draws (and always when nothing is held)."""

    policy: str
    held: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    latest_fraction: float = 1.0

    def __post_init__(self) -> None:
        if len(self.held) != len(self.weights):
            raise ValueError(
                f"league of {self.policy}: {len(self.held)} snapshots, {len(self.weights)} weights"
            )
        if any(w < 0 for w in self.weights) or not 0.0 <= self.latest_fraction <= 1.0:
            raise ValueError(f"league of {self.policy}: weights >= 0 and 0 <= latest_fraction <= 1 required")


@dataclass(frozen=True)
class OpponentRecord:
    """An agent that played a snapshot in an episode: its policy, the version, and the episode's score
    for the current version's agents against it (1 win, 0.5 tie, 0 loss; None when the workflow gave
    the opponent or every trained agent no reward to compare)."""

    policy: str
    version: int
    score: float | None


def draw(table: OpponentTable, key: str) -> int | None:
    """The snapshot version to play (None: the latest version) for the draw named `key`."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    rng = random.Random(seed)
    if not table.held or rng.random() < table.latest_fraction:
        return None
    weights = table.weights if sum(table.weights) > 0 else (1.0,) * len(table.held)
    return rng.choices(table.held, weights=weights)[0]


def opponent_score(
    rewards: Mapping[str, float], trained_agents: Iterable[str], opponent: str
) -> float | None:
    """1, 0.5 or 0 as the mean reward of `trained_agents` is above, equal to or below `opponent`'s."""
    mine = [rewards[a] for a in set(trained_agents) if a in rewards and a != opponent]
    if not mine or opponent not in rewards:
        return None
    ours, theirs = sum(mine) / len(mine), rewards[opponent]
    return 1.0 if ours > theirs else 0.0 if ours < theirs else 0.5
