"""`spec.data` (prompt rows by URI) and `spec.evaluation` (eval rows played every N steps, and
cross-play between versions)."""

from __future__ import annotations

from pydantic import Field

from polyrl_operator.api.base import ApiModel, Rule
from polyrl_operator.api.crossplay import CrossPlay
from polyrl_operator.api.patterns import _S3_URI

DATA_URI_PATTERN = (
    rf"^((pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.*|file:///.*|{_S3_URI})\.(jsonl|json|parquet)"
    r"|reasoning-gym://[a-z0-9_]+/?(\?.*)?)$"
)


class Data(ApiModel):
    """Prompt data: each episode group plays one row of `train` (the workflow reads it as
    `ctx.sample`); `eval` rows are played by `evaluation`, never trained on."""

    train: str = Field(
        ...,
        max_length=1024,
        pattern=DATA_URI_PATTERN,
        description="Training rows: a JSONL (one JSON object per line) or Parquet file by URI "
        "(pvc://claim/path, file:///path, s3://bucket/key), or reasoning-gym://DATASET?size=N&seed=S"
        "&PARAM=VALUE: rows generated at start by that reasoning-gym dataset with its own config "
        "parameters (seed 0 unless given), scored by the reward reasoning_gym.",
    )
    eval: str | None = Field(
        None,
        max_length=1024,
        pattern=DATA_URI_PATTERN,
        description="Evaluation rows (same formats; a reasoning-gym dataset with another seed than "
        "train's, or its rows are train's).",
    )
    shuffle: bool = Field(True, description="Shuffle the training rows each epoch, with training.seed.")
    epochs: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Passes over the training rows; the job ends after them or at totalSteps, whichever "
        "comes first. Unset: as many as totalSteps needs.",
    )


class Evaluation(ApiModel):
    """Periodic evaluation on `data.eval`: the current policies play every eval row without training
    on it; the results go to the metrics, /progress and the RLJob status per policy."""

    __rules__ = (
        Rule(
            cel="!self.greedy || self.k == 1",
            message="greedy evaluation plays each row once: k must be 1 (set greedy: false for pass@k)",
            check=lambda e: not e.greedy or e.k == 1,
            field=".k",
        ),
    )

    every_steps: int = Field(10, ge=1, le=10_000_000, description="Evaluate every N steps (and at the end).")
    before_training: bool = Field(
        True,
        description="Also evaluate once before the first step (step 0), so every run shows where the "
        "policies started; a resumed job does not evaluate again before its next step.",
    )
    k: int = Field(1, ge=1, le=64, description="Episodes per eval row: pass@k counts a row solved if any is.")
    greedy: bool = Field(True, description="Greedy decoding (temperature 0); false samples as in training.")
    max_rows: int | None = Field(
        None, ge=1, le=1_000_000, description="Play only the first N eval rows (unset: all)."
    )
    pass_threshold: float = Field(
        1.0, description="An episode solves its row for a policy when that policy's reward is at least this."
    )
    cross_play: CrossPlay | None = Field(
        None,
        description="Also play recent versions of pairs of policies against each other (a matrix per "
        "pair, and ratings of every version). With crossPlay, data.eval is optional: games need no rows.",
    )
