"""Role pods (``polyrl_operator.builders.pods``), table-driven: each row is a job (an example with
spec fields set), the pod asked for, and the parts of the built pod it expects.

The parts are paths into ``polyrl_testenv.manifest_view.pod_view`` (``("env", NAME)``,
``("claims", CLAIM)``, ``("spec", "nodeSelector")``, ...); ``MISSING`` is a part the pod must not have.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pytest
import yaml

from polyrl_operator import naming
from polyrl_operator.api import RLJob
from polyrl_operator.builders import JobRef, PodRequest, build_pod
from polyrl_operator.builders.pods import claims
from polyrl_operator.builders.priority import Priority
from polyrl_operator.roles import Role
from polyrl_operator.settings import OperatorSettings, Placement
from polyrl_testenv.bad_rljobs import REPO
from polyrl_testenv.manifest_view import MISSING, ViewPath, parts, pod_view, renamed_job, with_set
from polyrl_testenv.operator_fixtures import gpu_job, stored_job

Example = Literal["gpu", "cpu"]
REFS: dict[Example, JobRef] = {
    "gpu": JobRef("debate", "team-a", "uid-1"),  # manifests/examples/debate-gpu.yaml
    "cpu": JobRef("signal-game", "team-a", "uid-1"),  # manifests/examples/signal-game-cpu.yaml
}
L40S = OperatorSettings(
    gpu_types={
        "l40s": Placement(
            node_selector={"node.kubernetes.io/instance-type": "g6e.xlarge"},
            tolerations=[{"key": "gpu", "operator": "Exists"}],
        )
    }
)
CONFIG = "/etc/polyrl/config/rljob.json"
TOKEN_REF = {"secretKeyRef": {"name": "debate-ray-token", "key": "ray-token"}}


def rljob(example: Example, changes: tuple[tuple[str, Any], ...] = ()) -> RLJob:
    """The example job with each dotted path of its spec set (``policies.0.model.uri``, ...)."""
    body, ref = (gpu_job() if example == "gpu" else stored_job()), REFS[example]
    return renamed_job(body, ref.name, ref.namespace, changes)


@dataclass(frozen=True)
class PodCase:
    id: str
    req: PodRequest
    expected: Mapping[ViewPath, Any]
    example: Example = "gpu"
    spec: tuple[tuple[str, Any], ...] = ()
    settings: OperatorSettings | None = None
    priority: Priority | None = None


# Node placement, GPUs, command and the contract's environment.
PLACEMENT = [
    PodCase(
        "rollout: the admin's mapping, GPUs, worker args, the Ray address and token, the priority class",
        PodRequest("rollout", 3, "proposer"),
        {
            ("name",): "debate-proposer-rollout-3",
            ("spec", "nodeSelector"): {"node.kubernetes.io/instance-type": "g6e.xlarge"},
            ("spec", "tolerations"): [{"key": "gpu", "operator": "Exists"}],
            ("container", "resources"): {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}},
            ("container", "command"): ["polyrl-runtime"],
            ("container", "args"): [
                "worker",
                "--config",
                CONFIG,
                "--role",
                "rollout",
                "--policy",
                "proposer",
            ],
            ("env", "POLYRL_COORDINATOR_ADDRESS"): "debate-coordinator.team-a.svc:6379",
            ("env", "RAY_AUTH_TOKEN"): TOKEN_REF,
            ("spec", "subdomain"): "debate-proposer-rollout",
            # The job names a queue: its pods name the class only once it resolved to a PriorityClass.
            ("spec", "priorityClassName"): "rl-batch",
            ("volumes", "dshm"): {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        },
        settings=L40S,
        priority=Priority("rl-batch", "PriorityClass", 9),
    ),
    PodCase(
        "trainer: an unmapped GPU type becomes a node label; the attempt label; the role's env",
        PodRequest("trainer", 0, "judge", attempt=2),
        {
            ("spec", "nodeSelector"): {"polyrl.dev/gpu-type": "h100"},
            ("labels", naming.LABEL_ATTEMPT): "2",
            ("env", "NCCL_DEBUG"): "WARN",
        },
        settings=L40S,
    ),
    PodCase(
        "coordinator: no GPU, no placement, the coordinator's entry point",
        PodRequest("coordinator"),
        {
            ("spec", "nodeSelector"): MISSING,
            ("container", "resources"): MISSING,
            ("container", "args"): ["coordinator", "--config", CONFIG],
            ("spec", "subdomain"): MISSING,
        },
        settings=L40S,
    ),
    PodCase(
        "a podTemplate merges strategically",
        PodRequest("trainer", 0, "speaker"),
        {
            ("mount_names",): ["config", "podinfo", "scratch", "data"],
            ("volume_names",): ["config", "podinfo", "scratch", "data"],
            ("container", "image"): OperatorSettings().default_image,
            ("spec", "serviceAccountName"): "trainer",
            ("labels", "team"): "a",
            ("labels", naming.LABEL_ROLE): "trainer",
        },
        example="cpu",
        spec=(
            (
                "policies.0.trainer.podTemplate",
                {
                    "metadata": {"labels": {"team": "a"}, "annotations": {"note": "x"}},
                    "spec": {
                        "containers": [
                            {"name": "main", "volumeMounts": [{"name": "data", "mountPath": "/data"}]}
                        ],
                        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
                        "tolerations": [{"key": "spot", "operator": "Exists"}],
                        "serviceAccountName": "trainer",
                    },
                },
            ),
        ),
    ),
]

# pvc:// URIs mount their claims where the runtime looks (POLYRL_PVC_MOUNTS): the checkpoint claim
# on the coordinator and every trainer (each rank writes its shard), the model claim read-only on the
# policy's engines and writable on its trainers, nothing on pods that need no claim.
PVC_SPEC = (("checkpoint.uri", "pvc://ckpt/runs/signal"), ("policies.0.model.uri", "pvc://models/speaker"))
CKPT = {"path": "/mnt/polyrl/pvc/ckpt", "readOnly": False}
CLAIMS = [
    PodCase(
        f"claims: {req.role} {req.policy or ''}".rstrip(),
        req,
        {("claims",): mounts, ("pvc_mounts",): {c: m["path"] for c, m in mounts.items()}},
        example="cpu",
        spec=PVC_SPEC,
    )
    for req, mounts in [
        (PodRequest("coordinator"), {"ckpt": CKPT}),
        (
            PodRequest("trainer", 0, "speaker"),
            {"ckpt": CKPT, "models": {"path": "/mnt/polyrl/pvc/models", "readOnly": False}},
        ),
        (
            PodRequest("rollout", 0, "speaker"),
            {"models": {"path": "/mnt/polyrl/pvc/models", "readOnly": True}},
        ),
        (PodRequest("rollout", 0, "listener"), {}),
        (PodRequest("workflow"), {}),
        (PodRequest("trainer", 0, "listener"), {"ckpt": CKPT}),
    ]
]

# The Ray dashboard's port only on the coordinator, and only when the head serves it.
HEAD = {"http": 8000, "gcs": 6379, "client": 10001}
PORTS = [
    PodCase(
        f"ports: coordinator, dashboard {dashboard}",
        PodRequest("coordinator"),
        {("ports",): ports},
        example="cpu",
        spec=(() if dashboard is None else (("coordinator", {"dashboard": dashboard}),)),
    )
    for dashboard, ports in [(None, HEAD), (False, HEAD), (True, {**HEAD, "dashboard": 8265})]
] + [
    PodCase(
        f"ports: {req.role} never has the dashboard",
        req,
        {("ports",): ports},
        example="cpu",
        spec=(("coordinator", {"dashboard": True}),),
    )
    for req, ports in [
        (PodRequest("workflow"), {"http": 8000}),
        (PodRequest("rollout", 0, "speaker"), {"http": 8000}),
        (PodRequest("trainer", 0, "speaker"), {"http": 8000, "rendezvous": 29500}),
    ]
]

# Secrets as environment: spec.storage.credentialsSecret on every pod (and its name, for the
# runtime's errors), spec.metrics.credentialsSecret on the coordinator only (where the sinks run).
# The values never appear in the pod spec.
ONE_POD_PER_ROLE = (
    PodRequest("coordinator"),
    PodRequest("workflow", 0),
    PodRequest("rollout", 1, "proposer"),
    PodRequest("trainer", 0, "judge"),
)
S3 = {"secretRef": {"name": "s3"}}
WANDB = {"secretRef": {"name": "wandb-key"}}
METRICS_SECRETS: list[tuple[str, tuple[tuple[str, Any], ...], Any, Any]] = [
    ("unset", (), MISSING, MISSING),
    ("metrics secret", (("metrics", {"credentialsSecret": "wandb-key"}),), [WANDB], MISSING),
    (
        "both secrets",
        (("metrics", {"credentialsSecret": "wandb-key"}), ("storage", {"credentialsSecret": "s3"})),
        [S3, WANDB],
        [S3],
    ),
    (
        "one Secret for both: listed once",
        (("metrics", {"credentialsSecret": "all"}), ("storage", {"credentialsSecret": "all"})),
        [{"secretRef": {"name": "all"}}],
        [{"secretRef": {"name": "all"}}],
    ),
]
STORAGE_SECRETS: list[tuple[str, tuple[tuple[str, Any], ...], str | None]] = [
    ("unset", (), None),
    ("empty", (("storage", {}),), None),
    ("secret", (("storage", {"credentialsSecret": "s3-creds"}),), "s3-creds"),
    ("dotted name", (("storage", {"credentialsSecret": "team.s3"}),), "team.s3"),
]
SECRETS = [
    PodCase(
        f"metrics secret ({case}): {req.role}",
        req,
        {("envFrom",): coordinator if req.role == "coordinator" else others},
        spec=spec,
    )
    for case, spec, coordinator, others in METRICS_SECRETS
    for req in ONE_POD_PER_ROLE
] + [
    PodCase(
        f"storage secret ({case}): {req.role}",
        req,
        {
            ("envFrom",): [{"secretRef": {"name": secret}}] if secret else MISSING,
            ("env", "POLYRL_CREDENTIALS_SECRET"): secret or MISSING,
        },
        spec=spec,
    )
    for case, spec, secret in STORAGE_SECRETS
    for req in ONE_POD_PER_ROLE
]
SECRETS.append(
    PodCase(
        "storage secret: the role's own env wins over the secret's name",
        PodRequest("coordinator"),
        {
            ("env_entries", "POLYRL_CREDENTIALS_SECRET"): [
                {"name": "POLYRL_CREDENTIALS_SECRET", "value": "mine"}
            ],
            ("envFrom",): [{"secretRef": {"name": "s3-creds"}}],
        },
        spec=(
            ("storage", {"credentialsSecret": "s3-creds"}),
            ("coordinator.env", [{"name": "POLYRL_CREDENTIALS_SECRET", "value": "mine"}]),
        ),
    )
)

CASES = PLACEMENT + CLAIMS + PORTS + SECRETS


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_build_pod(case: PodCase) -> None:
    job = rljob(case.example, case.spec)
    settings = case.settings or OperatorSettings()
    pod = build_pod(job, REFS[case.example], case.req, settings, case.priority)
    assert parts(pod_view(pod), case.expected) == dict(case.expected)


# claims() on its own: the coordinator, which reads spec.data, mounts the data's claims read-only;
# other roles do not; a claim that is also the checkpoint's is mounted writable.
SELFPLAY = REPO / "tests" / "runtime" / "data" / "selfplay-tiny.yaml"
DATA_CLAIMS: list[tuple[str, dict[str, Any] | None, str | None, Role, dict[str, bool]]] = [
    ("train on a claim", {"train": "pvc://prompts/train.jsonl"}, None, "coordinator", {"prompts": True}),
    ("train and eval on two claims", {"train": "pvc://prompts/t.jsonl", "eval": "pvc://evals/e.parquet"}, None, "coordinator", {"prompts": True, "evals": True}),
    ("workflow pods read no data", {"train": "pvc://prompts/train.jsonl"}, None, "workflow", {}),
    ("s3 data needs no claim", {"train": "s3://bucket-a/train.jsonl"}, None, "coordinator", {}),
    ("the checkpoint's claim: writable wins", {"train": "pvc://shared/data/train.jsonl"}, "pvc://shared/ckpt", "coordinator", {"shared": False}),
    ("no data", None, None, "coordinator", {}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "data", "ckpt", "role", "expected"), DATA_CLAIMS, ids=[c[0] for c in DATA_CLAIMS]
)
def test_data_claims(
    case: str, data: dict[str, Any] | None, ckpt: str | None, role: Role, expected: dict[str, bool]
) -> None:
    doc = yaml.safe_load(SELFPLAY.read_text())
    changes = ((("data", data),) if data is not None else ()) + (
        (("checkpoint.uri", ckpt),) if ckpt is not None else ()
    )
    job = RLJob.model_validate({**doc, "spec": with_set(doc["spec"], changes)})
    assert claims(job, role, None) == expected
