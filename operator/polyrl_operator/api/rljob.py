"""The RLJob resource: group, version, names, and the root model (metadata + spec + status)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field

from polyrl_operator.api.base import ApiModel, Rule
from polyrl_operator.api.common import DNS_LABEL_PATTERN
from polyrl_operator.api.spec import RLJobSpec
from polyrl_operator.api.status import RLJobStatus

GROUP = "polyrl.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ("rlj",)
CATEGORIES = ("polyrl", "all")
"""`kubectl get polyrl` lists polyrl's kinds; `kubectl get all` includes RLJobs, as it does KubeRay's jobs."""

_DNS_1035 = re.compile(DNS_LABEL_PATTERN)
ROLE_NAME_LEN = len("rollout")  # == len("trainer"): the two per-policy roles
MAX_NAME_LEN = 63


def longest_pod_name_len(job: str, policy: str, rollout_max: int, trainer_replicas: int) -> int:
    """Length of the longest per-policy pod name `<job>-<policy>-<role>-<i>` the operator can create."""
    last_index = max(rollout_max, trainer_replicas) - 1
    return len(job) + 1 + len(policy) + 1 + ROLE_NAME_LEN + 1 + len(str(last_index))


def longest_pool_pod_name_len(job: str, pool: str, replicas_max: int) -> int:
    """Length of the longest pool pod name `<job>-pool-<pool>-<i>` the operator can create."""
    return len(job) + len("-pool-") + len(pool) + 1 + len(str(replicas_max - 1))


def _pod_names_fit(job: RLJob) -> bool:
    name = job.metadata.name
    return all(
        longest_pod_name_len(
            name,
            p.name,
            (p.rollout.replicas.max if p.rollout.replicas else 1),
            p.trainer.replicas or 1,
        )
        <= MAX_NAME_LEN
        for p in job.spec.policies
    )


def _pool_pod_names_fit(job: RLJob) -> bool:
    name = job.metadata.name
    return all(
        longest_pool_pod_name_len(name, q.name, q.replicas.max) <= MAX_NAME_LEN for q in job.spec.pools or ()
    )


# CEL twin of longest_pod_name_len and longest_pool_pod_name_len: 10 == two dashes around the
# 7-letter role, one before the index; 7 == "-pool-" and the dash before the index. A pooled role's
# unset replicas count as 1 here, as for a dedicated role's (its pods are the pool's).
_ROLLOUT_MAX_CEL = "(has(p.rollout.replicas) ? p.rollout.replicas.max : 1)"
_TRAINER_REPLICAS_CEL = "(has(p.trainer.replicas) ? p.trainer.replicas : 1)"
_POD_NAME_CEL = (
    "self.spec.policies.all(p, size(self.metadata.name) + size(p.name) + 10"
    f" + size(string(({_ROLLOUT_MAX_CEL} > {_TRAINER_REPLICAS_CEL}"
    f" ? {_ROLLOUT_MAX_CEL} : {_TRAINER_REPLICAS_CEL}) - 1)) <= 63)"
)
_POOL_POD_NAME_CEL = (
    "!has(self.spec.pools) || self.spec.pools.all(q, size(self.metadata.name) + size(q.name) + 7"
    " + size(string(q.replicas.max - 1)) <= 63)"
)


class ObjectMeta(ApiModel):
    """The part of metadata the API cares about; everything else in metadata is the API server's."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(..., min_length=1, max_length=MAX_NAME_LEN, description="Job name.")
    namespace: str | None = Field(None, description="Namespace.")


class RLJob(ApiModel):
    """RLJob trains several LLM policies that interact in one multi-agent episode program."""

    __rules__ = (
        Rule(
            cel=f"self.metadata.name.matches('{DNS_LABEL_PATTERN}')",
            message="must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter): "
            "it names the job's Services",
            check=lambda j: _DNS_1035.match(j.metadata.name) is not None,
            field=".metadata.name",
        ),
        Rule(
            cel=_POD_NAME_CEL,
            message="job name plus policy name too long: pod names <job>-<policy>-<role>-<index> "
            "must fit in 63 characters",
            check=_pod_names_fit,
            field=".spec.policies",
        ),
        Rule(
            cel=_POOL_POD_NAME_CEL,
            message="job name plus pool name too long: pod names <job>-pool-<pool>-<index> must fit in "
            "63 characters",
            check=_pool_pod_names_fit,
            field=".spec.pools",
        ),
    )

    api_version: Literal["polyrl.dev/v1alpha1"] = Field(
        "polyrl.dev/v1alpha1", description="polyrl.dev/v1alpha1"
    )
    kind: Literal["RLJob"] = Field("RLJob", description="RLJob")
    metadata: ObjectMeta = Field(..., description="Standard object metadata.")
    spec: RLJobSpec = Field(..., description="Desired state.")
    status: RLJobStatus | None = Field(None, description="Observed state, written by the operator.")
