"""A policy's league (`spec.policies[].league`): its past versions kept as snapshots and played as
opponents (`ctx.opponent` in the workflow), the remedy multi-agent RL found for self-play that only
meets the latest opponent and so cycles and forgets (AlphaStar's league, OpenAI Five's past selves).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from polyrl_operator.api.base import ApiModel

OpponentSampling = Literal["latest", "uniform", "pfsp"]


class League(ApiModel):
    """Snapshots of the policy's past versions, and how an opponent is drawn among them."""

    snapshot_every_steps: int = Field(
        5,
        ge=1,
        le=1_000_000,
        description="Take a snapshot of the policy's weights every this many training steps (and of "
        "its initial weights, version 0, at the start).",
    )
    keep: int = Field(
        4,
        ge=1,
        le=64,
        description="Snapshots that stay servable; taking one more evicts the oldest. Each costs, on "
        "every engine of the policy, one copy of its LoRA adapter on the engine's device, or for a "
        "policy without LoRA one copy of its weights in host memory (reported as league_bytes).",
    )
    resident_snapshots: int | None = Field(
        None,
        ge=1,
        le=64,
        description="A policy without LoRA only (default 1): how many snapshots each engine keeps "
        "loaded in serving copies of the model on its device, each costing one copy of the weights "
        "there (none more on a CPU engine, whose copies serve the host copies in place). A request "
        "for a snapshot no copy holds loads it into the least recently used idle copy, or waits "
        "for one to go idle. At most keep. A LoRA policy's snapshots are all resident (adapters "
        "on its base).",
    )
    sampling: OpponentSampling = Field(
        "uniform",
        description="How the opponent of an episode group is drawn when it is not the latest version: "
        "latest (never a snapshot: plain self-play, a baseline), uniform over the snapshots held, or "
        "pfsp (prioritised fictitious self-play: each snapshot weighted by pfspWeighting of the win "
        "rate of the current version's agents against it in the league's own episodes so far, 0.5 "
        "for a snapshot not yet played).",
    )
    pfsp_weighting: Literal["hard", "variance"] = Field(
        "hard",
        description="pfsp's weight of a snapshot the current version beats with win rate x: hard, "
        "(1 - x)^2 (the opponents it loses to most), or variance, x (1 - x) (the ones it is closest "
        "to). When every weight is 0 (it beats them all), the draw is uniform.",
    )
    latest_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="The share of episode groups whose opponent is the latest version (trained on like "
        "any turn) rather than a snapshot (never trained on).",
    )
