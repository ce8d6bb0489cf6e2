"""What isolates a job (``polyrl_operator.builders.security``), table-driven: every pod runs as the
job's own ServiceAccount with the restricted profile (per-role settings), and the job's
NetworkPolicies."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from polyrl_operator import naming
from polyrl_operator.api import RLJob
from polyrl_operator.builders import (
    JobRef,
    PodRequest,
    build_network_policies,
    build_pod,
    build_service_account,
)
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv.manifest_view import ViewPath, parts, pod_view
from polyrl_testenv.operator_fixtures import gpu_job

REF = JobRef("debate", "team-a", "uid-1")
RESTRICTED_POD = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
OWN_ACCOUNT: dict[ViewPath, Any] = {
    ("spec", "serviceAccountName"): "debate-runtime",
    ("spec", "automountServiceAccountToken"): False,
    ("spec", "securityContext"): RESTRICTED_POD,
    ("container", "securityContext"): RESTRICTED_CONTAINER,
    ("volumes", "scratch"): {"name": "scratch", "emptyDir": {}},
    ("env_entries", "RAY_AUTH_TOKEN"): [
        {
            "name": "RAY_AUTH_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "debate-ray-token", "key": "ray-token"}},
        }
    ],
}
ADMIN = {"podSecurity": {"runAsUser": 2000, "readOnlyRootFilesystem": {"workflow": False}}}

POD_CASES: list[tuple[str, PodRequest, dict[str, Any], Mapping[ViewPath, Any]]] = [
    *(
        (f"{req.role}: the job's own account, restricted", req, {}, OWN_ACCOUNT)
        for req in (
            PodRequest("coordinator"),
            PodRequest("workflow"),
            PodRequest("rollout", 0, "proposer"),
            PodRequest("trainer", 0, "judge"),
        )
    ),
    (
        "settings: a role turned off keeps a writable root",
        PodRequest("workflow", 0),
        ADMIN,
        {
            ("spec", "securityContext", "runAsUser"): 2000,
            ("container", "securityContext", "readOnlyRootFilesystem"): False,
        },
    ),
    (
        "settings: a role the setting does not list is off",
        PodRequest("trainer", 0, "judge"),
        ADMIN,
        {
            ("spec", "securityContext", "runAsUser"): 2000,
            ("container", "securityContext", "readOnlyRootFilesystem"): False,
        },
    ),
]


@pytest.mark.parametrize(("case", "req", "settings", "expected"), POD_CASES, ids=[c[0] for c in POD_CASES])
def test_pod_security(
    case: str, req: PodRequest, settings: dict[str, Any], expected: Mapping[ViewPath, Any]
) -> None:
    job = RLJob.model_validate({**gpu_job(), "metadata": {"name": "debate", "namespace": "team-a"}})
    pod = build_pod(job, REF, req, OperatorSettings.model_validate(settings))
    view = pod_view(pod)
    assert {"name": "scratch", "mountPath": "/tmp"} in view["container"]["volumeMounts"]
    assert parts(view, expected) == dict(expected)


def test_the_service_account_is_bound_to_nothing_and_mounts_no_token() -> None:
    account = build_service_account(REF)
    assert account["metadata"]["name"] == "debate-runtime"
    assert account["automountServiceAccountToken"] is False


CONFIGURED = {
    "networkPolicy": {
        "operatorNamespace": "ops",
        "operatorPodLabels": {"app": "op"},
        "extraIngress": [{"from": [{"namespaceSelector": {}}]}],
    }
}
NETWORK_CASES: list[tuple[str, dict[str, Any], dict[str, dict[str, Any]]]] = [
    (
        "isolation and progress, with the admin's extra rule",
        CONFIGURED,
        {
            "debate-isolation": {
                "podSelector": {"matchLabels": {naming.LABEL_JOB: "debate"}},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {"from": [{"podSelector": {"matchLabels": {naming.LABEL_JOB: "debate"}}}]},
                    {"from": [{"namespaceSelector": {}}]},
                ],
            },
            "debate-progress": {
                "podSelector": {"matchLabels": naming.selector("debate", "coordinator")},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [
                            {
                                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                                "podSelector": {"matchLabels": {"app": "op"}},
                            }
                        ],
                        "ports": [{"protocol": "TCP", "port": 8000}],
                    }
                ],
            },
        },
    ),
    ("turned off by the admin: none", {"networkPolicy": {"enabled": False}}, {}),
]


@pytest.mark.parametrize(("case", "settings", "expected"), NETWORK_CASES, ids=[c[0] for c in NETWORK_CASES])
def test_network_policies(case: str, settings: dict[str, Any], expected: dict[str, dict[str, Any]]) -> None:
    built = build_network_policies(REF, OperatorSettings.model_validate(settings))
    assert {p["metadata"]["name"]: p["spec"] for p in built} == expected
