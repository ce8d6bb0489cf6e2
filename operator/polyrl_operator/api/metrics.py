"""`spec.metrics`: the JSONL series next to the checkpoints and the optional sinks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from polyrl_operator.api.base import ApiModel, Rule
from polyrl_operator.api.patterns import CHECKPOINT_URI_PATTERN, SECRET_NAME_PATTERN

MLFLOW_URI_PATTERN = r"^(file:///.*|https?://.+|databricks(://.*)?)$"


class MetricsSink(ApiModel):
    """One place the per-step metrics also go, beside the JSONL series next to the checkpoints."""

    __rules__ = (
        Rule(
            cel="self.type != 'wandb' || has(self.project)",
            message="a wandb sink needs a project",
            check=lambda s: s.type != "wandb" or s.project is not None,
            field=".project",
        ),
        Rule(
            cel="self.type != 'mlflow' || has(self.trackingUri)",
            message="an mlflow sink needs a trackingUri",
            check=lambda s: s.type != "mlflow" or s.tracking_uri is not None,
            field=".trackingUri",
        ),
    )

    type: Literal["tensorboard", "wandb", "mlflow"] = Field(
        ...,
        description="tensorboard (event files), wandb (Weights & Biases) or mlflow. Each needs the "
        "runtime's `metrics` extra (pip install 'polyrl-runtime[metrics]').",
    )
    log_dir: str | None = Field(
        None,
        max_length=1024,
        pattern=CHECKPOINT_URI_PATTERN,
        description="tensorboard: where the event files go (pvc://, file:// or s3://); unset: "
        "<metrics directory>/tensorboard.",
    )
    project: str | None = Field(None, max_length=128, description="wandb: the project (required for wandb).")
    entity: str | None = Field(
        None, max_length=128, description="wandb: the team or user (unset: the key's)."
    )
    mode: Literal["online", "offline"] = Field(
        "online",
        description="wandb: online sends to the server (WANDB_API_KEY from metrics.credentialsSecret); "
        "offline writes a run directory to sync later with `wandb sync`.",
    )
    tracking_uri: str | None = Field(
        None,
        max_length=1024,
        pattern=MLFLOW_URI_PATTERN,
        description="mlflow: the tracking server (https://..., databricks) or a file:/// store "
        "(required for mlflow); MLFLOW_TRACKING_TOKEN etc. from metrics.credentialsSecret.",
    )
    experiment: str | None = Field(
        None, max_length=256, description="mlflow: the experiment name (unset: the job's name)."
    )


class Metrics(ApiModel):
    """Per-step metrics: always a JSONL series next to the checkpoints; optionally sinks."""

    sinks: list[MetricsSink] = Field(
        default_factory=list, max_length=8, description="Where the per-step metrics also go."
    )
    credentials_secret: str | None = Field(
        None,
        max_length=253,
        pattern=SECRET_NAME_PATTERN,
        description="A Secret in the job's namespace whose keys the coordinator pod gets as environment "
        "variables (envFrom), read by the sinks' clients: WANDB_API_KEY, MLFLOW_TRACKING_TOKEN or "
        "MLFLOW_TRACKING_USERNAME/PASSWORD, ... Never logged.",
    )
    max_sink_failures: int = Field(
        5,
        ge=1,
        le=1000,
        description="A sink that fails this many times in a row is disabled for the rest of the attempt "
        "(training never stops for a metrics sink).",
    )
