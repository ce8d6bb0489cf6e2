"""Pool pods (``build_pod`` for role ``pool``), table-driven like ``test_pods``: each row is a pooled
job (an example with roles placed on a pool, spec fields set), the pool pod asked for, and the parts
of the built pod it expects.

The GPU job's pool ``h100`` has 2 to 4 pods of 8 GPUs and hosts the proposer's rollout and trainer
and the critic's rollout; the CPU job's pool ``shared`` has 1 to 3 CPU pods and hosts the speaker's
rollout and trainer and the listener's rollout. A trainer runs on a pool's first replicas.min pods
only, so those pods are the ones that restart the job and mount what a trainer mounts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pytest

from polyrl_operator import naming
from polyrl_operator.api import RLJob
from polyrl_operator.builders import JobRef, PodRequest, build_pod
from polyrl_operator.builders.pods import claims
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv.manifest_view import MISSING, ViewPath, parts, pod_view, renamed_job
from polyrl_testenv.operator_fixtures import pooled_cpu_job, pooled_gpu_job

Example = Literal["gpu", "cpu"]
REFS: dict[Example, JobRef] = {
    "gpu": JobRef("debate", "team-a", "uid-1"),
    "cpu": JobRef("signal-game", "team-a", "uid-1"),
}
POOLS: dict[Example, str] = {"gpu": "h100", "cpu": "shared"}
CONFIG = "/etc/polyrl/config/rljob.json"
GPUS_8 = {"requests": {"nvidia.com/gpu": 8}, "limits": {"nvidia.com/gpu": 8}}


def rljob(example: Example, changes: tuple[tuple[str, Any], ...] = ()) -> RLJob:
    body, ref = (pooled_gpu_job() if example == "gpu" else pooled_cpu_job()), REFS[example]
    return renamed_job(body, ref.name, ref.namespace, changes)


@dataclass(frozen=True)
class PoolPodCase:
    id: str
    index: int
    expected: Mapping[ViewPath, Any]
    example: Example = "gpu"
    spec: tuple[tuple[str, Any], ...] = ()
    attempt: int = 0


def _serves(view: Mapping[str, Any]) -> Any:
    return (view["metadata"].get("annotations") or {}).get(naming.ANNOTATION_SERVES, MISSING)


IDENTITY = [
    PoolPodCase(
        "pod 0: name, labels, the roles it hosts, the pool's env and args, its GPUs and placement",
        0,
        {
            ("name",): "debate-pool-h100-0",
            ("labels", naming.LABEL_ROLE): "pool",
            ("labels", naming.LABEL_POOL): "h100",
            ("labels", naming.LABEL_POLICY): MISSING,
            ("labels", naming.LABEL_INDEX): "0",
            ("labels", naming.LABEL_ATTEMPT): "2",
            ("serves",): "proposer/rollout,proposer/trainer,critic/rollout",
            ("env", "POLYRL_ROLE"): "pool",
            ("env", "POLYRL_POOL"): "h100",
            ("env", "POLYRL_POLICY"): "",
            ("env", "POLYRL_INDEX"): "0",
            ("env", "POLYRL_ATTEMPT"): "2",
            ("env", "POLYRL_SERVICE"): "debate-pool-h100.team-a.svc",
            ("container", "args"): ["worker", "--config", CONFIG, "--role", "pool", "--pool", "h100"],
            ("container", "resources"): GPUS_8,
            ("container", "image"): "registry.example.com/polyrl-runtime:0.1.0-cuda",
            ("spec", "nodeSelector"): {"polyrl.dev/gpu-type": "h100"},
            ("spec", "subdomain"): "debate-pool-h100",
            ("spec", "hostname"): "debate-pool-h100-0",
            ("ports",): {"http": 8000, "rendezvous": 29500},
            ("volumes", "dshm"): {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        },
        attempt=2,
    ),
    PoolPodCase(
        "pod 1 (below replicas.min): still hosts the trainer",
        1,
        {
            ("name",): "debate-pool-h100-1",
            ("labels", naming.LABEL_ATTEMPT): "2",
            ("serves",): "proposer/rollout,proposer/trainer,critic/rollout",
            ("ports",): {"http": 8000, "rendezvous": 29500},
        },
        attempt=2,
    ),
    PoolPodCase(
        "pod 2 (past replicas.min): rollout engines only, no restart attempt, no rendezvous port",
        2,
        {
            ("name",): "debate-pool-h100-2",
            ("labels", naming.LABEL_ATTEMPT): MISSING,
            ("serves",): "proposer/rollout,critic/rollout",
            ("ports",): {"http": 8000},
            ("container", "resources"): GPUS_8,
        },
    ),
    PoolPodCase(
        "a CPU pool: no GPUs, no /dev/shm, no node placement; the pool's resources",
        0,
        {
            ("name",): "signal-game-pool-shared-0",
            ("container", "resources"): {"requests": {"cpu": "2", "memory": "4Gi"}},
            ("volumes", "dshm"): MISSING,
            ("spec", "nodeSelector"): MISSING,
            ("serves",): "speaker/rollout,speaker/trainer,listener/rollout",
        },
        example="cpu",
    ),
    PoolPodCase(
        "the pool's image, env and podTemplate; the roles it hosts win over a template annotation",
        0,
        {
            ("container", "image"): "pool-image:1",
            ("env", "NCCL_DEBUG"): "INFO",
            ("labels", "team"): "a",
            ("metadata", "annotations", "note"): "x",
            ("serves",): "proposer/rollout,proposer/trainer,critic/rollout",
            ("spec", "tolerations"): [{"key": "spot", "operator": "Exists"}],
        },
        spec=(
            ("pools.0.image", "pool-image:1"),
            ("pools.0.env", [{"name": "NCCL_DEBUG", "value": "INFO"}]),
            (
                "pools.0.podTemplate",
                {
                    "metadata": {
                        "labels": {"team": "a"},
                        "annotations": {"note": "x", naming.ANNOTATION_SERVES: "mine"},
                    },
                    "spec": {"tolerations": [{"key": "spot", "operator": "Exists"}]},
                },
            ),
        ),
    ),
]

# Claims: every policy the pod hosts a role of mounts its model claim, writable where the pod hosts
# that policy's trainer; the checkpoint claim only where it hosts a trainer.
PVC_SPEC = (
    ("checkpoint.uri", "pvc://ckpt/runs/signal"),
    ("policies.0.model.uri", "pvc://speaker-models/s"),
    ("policies.1.model.uri", "pvc://listener-models/l"),
)


def _claim(name: str, read_only: bool) -> dict[str, Any]:
    return {"path": f"/mnt/polyrl/pvc/{name}", "readOnly": read_only}


CLAIMS = [
    PoolPodCase(
        f"claims: pool pod {index}",
        index,
        {("claims",): mounts, ("pvc_mounts",): {c: m["path"] for c, m in mounts.items()}},
        example="cpu",
        spec=PVC_SPEC,
    )
    for index, mounts in [
        (
            0,
            {
                "ckpt": _claim("ckpt", False),
                "speaker-models": _claim("speaker-models", False),
                "listener-models": _claim("listener-models", True),
            },
        ),
        (
            1,
            {
                "speaker-models": _claim("speaker-models", True),
                "listener-models": _claim("listener-models", True),
            },
        ),
    ]
]

CASES = IDENTITY + CLAIMS


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_build_pool_pod(case: PoolPodCase) -> None:
    job = rljob(case.example, case.spec)
    req = PodRequest("pool", case.index, attempt=case.attempt, pool=POOLS[case.example])
    view = pod_view(build_pod(job, REFS[case.example], req, OperatorSettings()))
    view["serves"] = _serves(view)
    assert parts(view, case.expected) == dict(case.expected)


def test_one_claim_for_both_roles_is_writable() -> None:
    """The trainer's writable model claim wins over the rollout's read-only one on the same pod."""
    job = rljob("gpu")  # the proposer and the critic keep their models on one claim, "models"
    assert claims(job, "pool", "h100", 0) == {"models": False, "checkpoints": False}
    assert claims(job, "pool", "h100", 2) == {"models": True}


def test_a_pool_pod_names_its_pool() -> None:
    with pytest.raises(KeyError, match="no pool None in job debate"):
        build_pod(rljob("gpu"), REFS["gpu"], PodRequest("pool", 0), OperatorSettings())
