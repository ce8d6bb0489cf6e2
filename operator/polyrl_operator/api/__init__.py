"""The RLJob API (polyrl.dev/v1alpha1): the single source of truth for the CRD, validation, the
operator's planning and the runtime's configuration."""

from polyrl_operator.api.algorithm import Algorithm, Critic, Lora
from polyrl_operator.api.base import ApiModel, Rule, RuleViolation
from polyrl_operator.api.common import (
    EnvVar,
    PodTemplateOverride,
    Replicas,
    ResourceRequirements,
    RoleOverrides,
)
from polyrl_operator.api.crossplay import CrossPlay, CrossPlayPair
from polyrl_operator.api.league import League
from polyrl_operator.api.model import Model
from polyrl_operator.api.operation import FailurePolicy, Scheduling
from polyrl_operator.api.policy import Policy, Rollout, Sampling, Trainer
from polyrl_operator.api.pools import Placement, Pool, SharedBase
from polyrl_operator.api.rljob import (
    API_VERSION,
    CATEGORIES,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    RLJob,
    longest_pod_name_len,
)
from polyrl_operator.api.spec import (
    Checkpoint,
    Coordinator,
    RLJobSpec,
    Training,
    Workflow,
)
from polyrl_operator.api.status import (
    PHASES,
    Condition,
    PolicyStatus,
    PoolStatus,
    RLJobStatus,
    RoleCounts,
    Staleness,
)
from polyrl_operator.api.weight_sync import WeightSync

__all__ = [
    "API_VERSION",
    "CATEGORIES",
    "GROUP",
    "KIND",
    "PHASES",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "Algorithm",
    "ApiModel",
    "Checkpoint",
    "Condition",
    "Coordinator",
    "Critic",
    "CrossPlay",
    "CrossPlayPair",
    "EnvVar",
    "FailurePolicy",
    "League",
    "Lora",
    "Model",
    "Placement",
    "PodTemplateOverride",
    "Policy",
    "PolicyStatus",
    "Pool",
    "PoolStatus",
    "RLJob",
    "RLJobSpec",
    "RLJobStatus",
    "Replicas",
    "ResourceRequirements",
    "RoleCounts",
    "RoleOverrides",
    "Rollout",
    "Rule",
    "RuleViolation",
    "Sampling",
    "Scheduling",
    "SharedBase",
    "Staleness",
    "Trainer",
    "Training",
    "WeightSync",
    "Workflow",
    "longest_pod_name_len",
]
