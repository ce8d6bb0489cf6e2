"""`spec.evaluation.crossPlay`: how version i of one policy fares against version j of another (or of
itself), played outside training at every `everySteps`, as a matrix per pair of policies; the games
also rate every version played (coordinator/ratings.py).
"""

from __future__ import annotations

from pydantic import Field

from polyrl_operator.api.base import ApiModel
from polyrl_operator.api.common import DNS_LABEL_PATTERN

MAX_CROSSPLAY_PAIRS = 8


class CrossPlayPair(ApiModel):
    """One matrix: the `row` policy's versions (rows) against the `column` policy's (columns); a
    cell is the row version's score against the column version. `row` and `column` may be one policy
    with a league: its versions against each other (the column's play as `ctx.opponent`)."""

    row: str = Field(..., pattern=DNS_LABEL_PATTERN, max_length=63, description="A policy of spec.policies.")
    column: str = Field(
        ..., pattern=DNS_LABEL_PATTERN, max_length=63, description="A policy of spec.policies."
    )


class CrossPlay(ApiModel):
    """Cross-play passes: every `everySteps` steps of the pair's first trained policy (and at its
    last step), each recent version of one policy plays each recent version of the other."""

    pairs: list[CrossPlayPair] = Field(
        ...,
        min_length=1,
        max_length=MAX_CROSSPLAY_PAIRS,
        description="The matrices to play. In each pair one policy at least has a league (its past "
        "versions) or is frozen (a fixed reference), and one at least is trained.",
    )
    every_steps: int = Field(
        10, ge=1, le=10_000_000, description="Play the pairs every N steps (and at the last step)."
    )
    versions: int = Field(
        3,
        ge=1,
        le=16,
        description="Versions of each policy per matrix: its current version and its newest league "
        "snapshots (a policy without a league: its current version).",
    )
    episodes: int = Field(
        4,
        ge=1,
        le=256,
        description="Episodes per cell; episode e plays eval row e (modulo the rows) when the job has "
        "data.eval, and no row otherwise. Greedy or sampled as evaluation.greedy says.",
    )
    anchor: str | None = Field(
        None,
        pattern=DNS_LABEL_PATTERN,
        max_length=63,
        description="A frozen policy in one of the pairs whose version is the ratings' fixed point "
        "(anchorRating), so that ratings compare across runs (unset: each group of policies that "
        "played each other is anchored at version 0 of its first policy in spec.policies).",
    )
    anchor_rating: float = Field(
        1000.0, ge=-100_000, le=100_000, description="The anchor's rating, on the Elo scale."
    )
