"""The pod contract (``polyrl_operator.pod_contract``) holds on both sides: every variable the
builders put on a pod is one of its names, every name is given to some pod, neither package spells
a contract string itself, and the runtime reads what the builders give through it."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator import pod_contract as contract
from polyrl_operator.api import RLJob
from polyrl_operator.builders import JobRef, PodRequest, build_pod
from polyrl_operator.planning import render
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv.bad_rljobs import EXAMPLES, REPO
from polyrl_testenv.manifest_view import with_set

# Every feature that adds a variable: the GPU example mounts claims (models, checkpoints); the
# secrets add their own.
SECRETS = (("storage", {"credentialsSecret": "s3"}), ("metrics", {"credentialsSecret": "wandb"}))
# A device pool adds the pool pods' own variable (POLYRL_POOL).
POOLED = (
    ("pools", [{"name": "shared", "gpus": 0, "env": [{"name": "POOL_OWN", "value": "1"}]}]),
    ("policies.0.rollout", {"engine": "torch", "pool": "shared"}),
    ("policies.0.trainer", {"pool": "shared"}),
)
JOBS: list[tuple[str, Path, tuple[tuple[str, Any], ...]]] = [
    *((path.name, path, ()) for path in sorted(EXAMPLES.glob("*.yaml"))),
    ("debate-gpu.yaml with secrets", EXAMPLES / "debate-gpu.yaml", SECRETS),
    ("signal-game-cpu.yaml on a pool", EXAMPLES / "signal-game-cpu.yaml", POOLED),
]
OPERATOR = REPO / "operator" / "polyrl_operator"
RUNTIME = REPO / "runtime" / "polyrl_runtime"
CONTRACT_STRINGS = frozenset(
    {name for name in contract.POD_ENV if name.startswith("POLYRL_")}
    | {
        contract.ENV_NETMAP,
        contract.ANNOTATION_DRAIN,
        contract.ANNOTATION_CHECKPOINT_REQUEST,
        contract.CONFIG_DIR,
        contract.CONFIG_PATH,
        contract.PODINFO_DIR,
        contract.PVC_ROOT,
    }
)


def _pod_env(path: Path, changes: tuple[tuple[str, Any], ...]) -> tuple[set[str], set[str]]:
    """(every variable on the job's pods, the ones the job's own role env sets)."""
    body = yaml.safe_load(path.read_text())
    body["spec"] = with_set(body["spec"], changes)
    pods = [m for m in render(body, OperatorSettings()) if m["kind"] == "Pod"]
    given = {e["name"] for pod in pods for c in pod["spec"]["containers"] for e in c.get("env") or []}
    spec = body["spec"]
    roles = [spec.get("coordinator") or {}, spec["workflow"]]
    roles += [p.get(role) or {} for p in spec["policies"] for role in ("rollout", "trainer")]
    roles += spec.get("pools") or []
    own = {e["name"] for role in roles for e in role.get("env") or []}
    return given, own


@pytest.mark.parametrize(("case", "path", "changes"), JOBS, ids=[j[0] for j in JOBS])
def test_every_variable_the_builders_set_is_a_contract_name(
    case: str, path: Path, changes: tuple[tuple[str, Any], ...]
) -> None:
    given, own = _pod_env(path, changes)
    assert given - own <= contract.POD_ENV


def test_every_contract_name_is_given_to_some_pod() -> None:
    given = set().union(*(_pod_env(path, changes)[0] for _, path, changes in JOBS))
    assert given >= contract.POD_ENV


def _spelled(root: Path) -> list[str]:
    """``file:line: string`` for every string literal under ``root`` that is a contract string."""
    found = []
    for file in sorted(root.rglob("*.py")):
        if file == OPERATOR / "pod_contract.py":
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Constant) and node.value in CONTRACT_STRINGS:
                found.append(f"{file.relative_to(REPO)}:{node.lineno}: {node.value}")
    return found


@pytest.mark.parametrize("root", [OPERATOR, RUNTIME], ids=["operator", "runtime"])
def test_no_package_spells_a_contract_string_itself(root: Path) -> None:
    assert _spelled(root) == []


def test_the_contract_imports_nothing_heavy() -> None:
    """A pod's process logs its identity (from the contract's variables) before it imports pydantic."""
    tree = ast.parse((OPERATOR / "pod_contract.py").read_text())
    imported = {
        alias.name if isinstance(node, ast.Import) else str(node.module)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= {"__future__", "typing"}


def test_the_runtime_reads_what_the_builders_give(monkeypatch: pytest.MonkeyPatch) -> None:
    config = pytest.importorskip("polyrl_runtime.config", reason="the runtime is not installed")
    logs = pytest.importorskip("polyrl_runtime.logs")
    storage = pytest.importorskip("polyrl_runtime.storage")
    job = RLJob.model_validate(yaml.safe_load((EXAMPLES / "debate-gpu.yaml").read_text()))
    ref = JobRef("debate", "team-a", "uid-1")
    pod = build_pod(job, ref, PodRequest("trainer", 1, "judge", attempt=2), OperatorSettings())
    [container] = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    monkeypatch.delenv(contract.ENV_NETMAP, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert config.PodEnv.from_env() == config.PodEnv(
        job="debate",
        namespace="team-a",
        role="trainer",
        policy="judge",
        index=1,
        attempt=2,
        pod_name="debate-judge-trainer-1",
        coordinator_address="debate-coordinator.team-a.svc:6379",
        config="/etc/polyrl/config/rljob.json",
        podinfo_dir="/etc/polyrl/podinfo",
        http_port=8000,
    )
    assert logs.pod_fields(env) == {
        "job": "debate",
        "namespace": "team-a",
        "policy": "judge",
        "role": "trainer",
        "pod": "debate-judge-trainer-1",
    }
    assert storage.local_path("pvc://models/qwen3-4b") == Path("/mnt/polyrl/pvc/models/qwen3-4b")
    assert storage.local_path("pvc://checkpoints/debate/step-1") == Path(
        "/mnt/polyrl/pvc/checkpoints/debate/step-1"
    )
