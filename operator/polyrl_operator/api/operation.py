"""How the job is kept running: what to do when pods fail, the credentials its storage needs and
how it is admitted and prioritised (RLJobSpec's failurePolicy, storage and scheduling)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from polyrl_operator.api.base import ApiModel
from polyrl_operator.api.common import DNS_LABEL_PATTERN
from polyrl_operator.api.patterns import SECRET_NAME_PATTERN


class Storage(ApiModel):
    """Access to object storage (s3:// URIs of models and checkpoints)."""

    credentials_secret: str | None = Field(
        None,
        max_length=253,
        pattern=SECRET_NAME_PATTERN,
        description="A Secret in the job's namespace whose keys every pod of the job gets as environment "
        "variables (envFrom): AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, optionally AWS_SESSION_TOKEN, "
        "AWS_REGION and AWS_ENDPOINT_URL (an S3-compatible server such as MinIO or SeaweedFS). Unset: "
        "the pods' own environment (e.g. the node's or service account's IAM role). Never logged.",
    )


class FailurePolicy(ApiModel):
    """What to do when pods fail."""

    max_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="Restarts before the job fails. The coordinator's: the whole job restarts from the "
        "latest complete checkpoint, counted in status.restarts. A policy's trainer (a rank crashed, "
        "its pod lost): only that policy's trainer restarts, from that policy's part of the latest "
        "complete checkpoint, while the other policies train on; counted per policy in "
        "status.policies[].restarts (policies[].failurePolicy.maxRestarts overrides the limit).",
    )
    on_policy_failure: Literal["failJob", "freeze"] = Field(
        "failJob",
        description="What a policy whose trainer failed past its maxRestarts does: failJob fails the "
        "job; freeze stops training that policy (its engines keep serving its last version, its new "
        "samples are dropped as policy_finished) and trains the others on, reported in "
        "status.policies[].trainerState and the PolicyFrozen condition. freeze needs two policies or more.",
    )


class Scheduling(ApiModel):
    """Admission and priority."""

    queue_name: str | None = Field(
        None,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="Kueue LocalQueue that admits the job as one unit. Unset: the job's "
        "kueue.x-k8s.io/queue-name label, as Kueue reads it on its own jobs; when both are set, this "
        "field wins.",
    )
    priority_class_name: str | None = Field(
        None,
        max_length=253,
        description=(
            "The job's priority. With a queue it is resolved as Kueue does: a Kueue "
            "WorkloadPriorityClass of this name first (it orders admission and preemption; pods get "
            "no priorityClassName), else a scheduling.k8s.io PriorityClass (the Workload and every "
            "pod use it). Without a queue: the PriorityClass of every pod."
        ),
    )
