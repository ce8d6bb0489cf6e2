"""A cross-play episode in the workflow worker (`spec.evaluation.crossPlay`): the workflow's own episode
program, with every agent of the pair's policies held to one version, and its rewards read as the
row side's and the column side's.

Which version plays: `ctx.agent` (and an `Agent` a workflow builds itself) of a policy of the pair
plays that policy's version of the cell. `ctx.opponent` of the row's policy is played by the column
at its version: in a pair of one policy with itself, the column's past version; in a pair of two, the
column policy itself, so that a self-play workflow meets a fixed opponent (a frozen base model) in
its opponent's seat. `ctx.opponent` of the column's policy plays the column's version; of any other
league policy, its current weights. A version is a snapshot (its adapter on every engine of the
policy) or the current weights (None). Nothing is trained on these episodes: they never reach the
buffer.

The sides: the agents of each policy, and in a pair of one policy, its agents from `ctx.agent` (row)
and from `ctx.opponent` (column). A side's reward is its agents' mean; a side with no rewarded agent
is None (the policies never met in the episode).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class CrossPlayGame:
    """One cell's pairing: `row` at `row_version` against `column` at `column_version` (None: the
    current weights)."""

    row: str
    column: str
    row_version: int | None
    column_version: int | None

    def agent_versions(self) -> dict[str, int]:
        """Policy -> the snapshot its `ctx.agent` agents play (absent: the current weights)."""
        out = {} if self.row_version is None else {self.row: self.row_version}
        if self.column != self.row and self.column_version is not None:
            out[self.column] = self.column_version
        return out

    def stand_ins(self) -> dict[str, tuple[str, int | None]]:
        """Policy -> who plays its `ctx.opponent` agents: the column at its version, for the row's
        opponents (the row's own past version in a pair of one policy, another policy in a pair of
        two) and for the column's own."""
        return {self.row: (self.column, self.column_version), self.column: (self.column, self.column_version)}


@dataclass(frozen=True)
class CrossPlayResult:
    """One cross-play episode's side rewards (None: that side had no rewarded agent)."""

    row_reward: float | None
    column_reward: float | None

    @property
    def score(self) -> float | None:
        """The row side's score against the column side: 1, 0.5 or 0 (None: a side is missing)."""
        if self.row_reward is None or self.column_reward is None:
            return None
        if self.row_reward == self.column_reward:
            return 0.5
        return 1.0 if self.row_reward > self.column_reward else 0.0


def sides(
    game: CrossPlayGame,
    rewards: Mapping[str, float],
    roster: Mapping[str, str],
    opponents: Iterable[str],
) -> CrossPlayResult:
    """The episode's side rewards from its agents' rewards, each agent's policy (`roster`) and the
    agents that played as `ctx.opponent`."""
    opp = set(opponents)
    if game.row == game.column:
        row = [r for a, r in rewards.items() if roster.get(a) == game.row and a not in opp]
        col = [r for a, r in rewards.items() if roster.get(a) == game.row and a in opp]
    else:
        row = [r for a, r in rewards.items() if roster.get(a) == game.row]
        col = [r for a, r in rewards.items() if roster.get(a) == game.column]
    return CrossPlayResult(sum(row) / len(row) if row else None, sum(col) / len(col) if col else None)
