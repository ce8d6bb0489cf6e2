"""Reading the RLJob: the same pydantic models the operator plans with, from YAML or JSON.

`load_job(path)` accepts the file a user writes (`polyrl run job.yaml`, which may hold several YAML
documents: the first RLJob is used) and the JSON the operator mounts in pods (`POLYRL_CONFIG`). Errors
name the file, the line and the field, exactly as `polyrl validate` does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl_operator import pod_contract as contract
from polyrl_operator.api import RLJob
from polyrl_operator.validation import load_rljobs
from polyrl_runtime import netmap

ENV_DEFAULTS = {
    "OMP_NUM_THREADS": "1",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
    # Ray runs its workers at nice 15 by default, below the driver and every other process on the
    # machine. The actors (engines, trainers, workflow workers) are the job's work: on a shared
    # machine they must not yield to everything else. Read by the raylet when it starts.
    "RAY_worker_niceness": "0",
    # A raylet exits when its runtime-env agent (a Python process it starts) does not answer within
    # this many ms of the first worker start: Ray's 30 s, on a loaded machine where several nodes
    # start at once, killed a raylet at start. Read by the raylet when it starts.
    "RAY_agent_register_timeout_ms": "120000",
}


class JobFileError(ValueError):
    """The job file cannot be read or is not a valid RLJob; the message names the file and field."""


def set_env_defaults() -> None:
    """Environment every runtime process wants before torch/ray start (explicit settings win).
    Logging is configured by each entry point (`polyrl_runtime.logs`), before this."""
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "polyrl" / "torch_extensions"))


def load_job(path: str | Path) -> RLJob:
    """The first RLJob of the file. Every problem `polyrl validate` would report fails it, in the same
    words (polyrl_operator.validation): one line per problem, naming file, line and field."""
    path = Path(path)
    jobs, _, problems = load_rljobs(path)
    if problems:
        raise JobFileError("\n".join(str(p) for p in problems))
    if not jobs:
        raise JobFileError(f"{path}: no document with kind: RLJob")
    return jobs[0]


@dataclass(frozen=True)
class PodEnv:
    """What the operator tells a pod through its environment (docs/runtime-contract.md)."""

    job: str
    namespace: str
    role: str
    policy: str
    index: int
    attempt: int
    pod_name: str
    coordinator_address: str
    config: str
    podinfo_dir: str
    http_port: int

    @classmethod
    def from_env(cls, **overrides: Any) -> PodEnv:
        e = os.environ
        values: dict[str, Any] = {
            "job": e.get(contract.ENV_JOB, ""),
            "namespace": e.get(contract.ENV_NAMESPACE, ""),
            "role": e.get(contract.ENV_ROLE, ""),
            "policy": e.get(contract.ENV_POLICY, ""),
            "index": int(e.get(contract.ENV_INDEX, "0") or 0),
            "attempt": int(e.get(contract.ENV_ATTEMPT, "0") or 0),
            "pod_name": e.get(contract.ENV_POD_NAME, ""),
            "coordinator_address": e.get(contract.ENV_COORDINATOR_ADDRESS, ""),
            "config": e.get(contract.ENV_CONFIG, contract.CONFIG_PATH),
            "podinfo_dir": e.get(contract.ENV_PODINFO_DIR, contract.PODINFO_DIR),
            "http_port": netmap.listen_port(int(e.get(contract.ENV_HTTP_PORT) or contract.PORT_HTTP)),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def read_annotations(podinfo_dir: str) -> dict[str, str]:
    """The downward-API `annotations` file (`key="value"` lines); {} when absent."""
    path = Path(podinfo_dir) / contract.PODINFO_ANNOTATIONS
    try:
        text = path.read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = json.loads(value) if value.startswith('"') else value
    return out


def resource_name(policy: str | None, role: str) -> str:
    """The Ray custom resource that places a role's actors: `polyrl/<policy>/<role>` or `polyrl/<role>`."""
    return f"polyrl/{policy}/{role}" if policy else f"polyrl/{role}"


def placement_resources(job: RLJob) -> dict[str, float]:
    """The units of each placement resource the job's actors need at their minimum replica counts:
    what a one-machine cluster offers, and what a coordinator waits to see joined in pods."""
    res: dict[str, float] = {resource_name(None, "workflow"): float(job.spec.workflow.replicas.min)}
    for p in job.spec.policies:
        res[resource_name(p.name, "rollout")] = float(p.rollout.replicas.min)
        res[resource_name(p.name, "trainer")] = float(p.trainer.replicas * p.trainer.ranks)
    return res
