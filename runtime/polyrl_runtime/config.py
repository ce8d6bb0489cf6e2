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
    pool: str = ""
    """The pool a pool pod belongs to (its `--pool` default); empty on every other pod."""

    @classmethod
    def from_env(cls, **overrides: Any) -> PodEnv:
        e = os.environ
        values: dict[str, Any] = {
            "job": e.get(contract.ENV_JOB, ""),
            "namespace": e.get(contract.ENV_NAMESPACE, ""),
            "role": e.get(contract.ENV_ROLE, ""),
            "policy": e.get(contract.ENV_POLICY, ""),
            "pool": e.get(contract.ENV_POOL, ""),
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
    what a one-machine cluster offers, and what a coordinator waits to see joined in pods. A pooled
    role counts as a dedicated one would on its pool's pods: an engine per pod at the pool's
    replicas.min, `ranks_per_pod` ranks on each of those pods (the sum of `node_resources` over them)."""
    res: dict[str, float] = {resource_name(None, "workflow"): float(job.spec.workflow.replicas.min)}
    for p in job.spec.policies:
        res[resource_name(p.name, "rollout")] = float(job.spec.rollout_placement(p).min_replicas)
        res[resource_name(p.name, "trainer")] = float(job.spec.trainer_placement(p).trainer_world)
    return res


def node_resources(
    job: RLJob, role: str, policy: str | None, pool: str | None, index: int
) -> dict[str, float]:
    """The placement resources a worker pod's Ray node offers: the only way the job's actors land on
    it (each asks for one unit of `resource_name(policy, role)`).

    - rollout or workflow: one unit (one engine, one workflow worker);
    - trainer: one unit per rank of the pod (`trainer_placement(...).ranks_per_pod`);
    - pool (pod `index` of pool `pool`): the units of every role that names the pool, so the fleet
      places pooled actors exactly as dedicated ones: one engine of each pooled rollout on every pod,
      and `ranks_per_pod` ranks of each pooled trainer on the pods whose index is below the pool's
      replicas.min (a trainer's world is fixed; the pods above it are the rollouts' elastic part).

    `policy` and `pool` must name ones the job has (`run_worker` checks them first): ValueError
    (or KeyError for an unknown pool) otherwise."""
    spec = job.spec
    if role == "workflow":
        return {resource_name(None, "workflow"): 1.0}
    if role == "pool":
        if pool is None:
            raise ValueError("a pool pod needs its pool's name")
        first_pods = index < spec.pool(pool).replicas.min
        res: dict[str, float] = {}
        for p in spec.policies:
            if p.rollout.pool == pool:
                res[resource_name(p.name, "rollout")] = 1.0
            if p.trainer_pool == pool and first_pods:
                res[resource_name(p.name, "trainer")] = float(spec.trainer_placement(p).ranks_per_pod)
        return res
    found = next((p for p in spec.policies if p.name == policy), None)
    if found is None or role not in ("rollout", "trainer"):
        raise ValueError(f"no {role} pod for policy {policy!r}")
    units = spec.trainer_placement(found).ranks_per_pod if role == "trainer" else 1
    return {resource_name(found.name, role): float(units)}
