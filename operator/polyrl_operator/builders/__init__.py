"""Pure builders: RLJob spec (+ settings) -> Kubernetes manifest dicts. No I/O, no clock, no randomness.

Every manifest carries the job's labels, a controller ownerReference to the RLJob and the hash of its
own content (``polyrl.dev/spec-hash``), which is how apply detects drift without comparing fields the
API server defaults.
"""

from polyrl_operator.builders.common import JobRef, manifest_hash, owner_reference, stamp_hash
from polyrl_operator.builders.config import build_config_map, build_secret, runtime_config
from polyrl_operator.builders.merge import strategic_merge
from polyrl_operator.builders.pods import PodRequest, build_pod
from polyrl_operator.builders.security import build_network_policies, build_service_account
from polyrl_operator.builders.services import build_coordinator_service, build_headless_service
from polyrl_operator.builders.workload import admitted_placement, build_workload, podset_sizes

__all__ = [
    "JobRef",
    "PodRequest",
    "admitted_placement",
    "build_config_map",
    "build_coordinator_service",
    "build_headless_service",
    "build_network_policies",
    "build_pod",
    "build_secret",
    "build_service_account",
    "build_workload",
    "manifest_hash",
    "owner_reference",
    "podset_sizes",
    "runtime_config",
    "stamp_hash",
    "strategic_merge",
]
