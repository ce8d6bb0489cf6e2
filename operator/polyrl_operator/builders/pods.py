"""Role pods: coordinator, workflow workers, and per policy rollout engines and trainers.

Bare pods with stable names (``<job>-<policy>-<role>-<i>``) so the operator picks which replica to
drain or replace. The container is always named ``main`` and runs the runtime's entry points
(``polyrl-runtime coordinator --config FILE`` on the coordinator, ``polyrl-runtime worker --config FILE
--role ROLE [--policy NAME]`` everywhere else); everything else the runtime needs arrives as env, the config
file and the downward-API volume, as written down in docs/runtime-contract.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from polyrl_operator import naming
from polyrl_operator.api import Policy, RLJob, RoleOverrides
from polyrl_operator.builders.common import JobRef, Manifest, metadata, stamp_hash
from polyrl_operator.builders.merge import strategic_merge
from polyrl_operator.builders.priority import Priority, pod_priority_class
from polyrl_operator.builders.security import (
    SCRATCH_DIR,
    SCRATCH_ENV,
    container_security_context,
    pod_security_context,
)
from polyrl_operator.naming import Role
from polyrl_operator.settings import GPU_RESOURCE, OperatorSettings, Placement


@dataclass(frozen=True)
class PodRequest:
    """Which pod to build."""

    role: Role
    index: int = 0
    policy: str | None = None
    attempt: int = 0
    """Restart attempt (status.restarts) the pod belongs to; used for coordinator and trainers."""
    flavor: Placement | None = None
    """Node placement from the Kueue admission (ResourceFlavor nodeLabels/tolerations)."""


def pod_name(job: str, req: PodRequest) -> str:
    if req.role == "coordinator":
        return naming.coordinator_pod(job)
    if req.role == "workflow":
        return naming.workflow_pod(job, req.index)
    assert req.policy is not None, "rollout and trainer pods belong to a policy"
    return naming.policy_pod(job, req.policy, req.role, req.index)


def _policy(job: RLJob, name: str | None) -> Policy:
    for p in job.spec.policies:
        if p.name == name:
            return p
    raise KeyError(f"no policy {name!r} in job {job.metadata.name}")


def role_spec(job: RLJob, role: Role, policy: str | None) -> tuple[RoleOverrides, int, str | None]:
    """The role's overrides, GPUs per pod and GPU type."""
    if role == "coordinator":
        return job.spec.coordinator, 0, None
    if role == "workflow":
        return job.spec.workflow, 0, None
    p = _policy(job, policy)
    if role == "rollout":
        return p.rollout, p.rollout.gpus, p.rollout.gpu_type
    return p.trainer, p.trainer.gpus, p.trainer.gpu_type


def role_image(job: RLJob, role: Role, policy: str | None, settings: OperatorSettings) -> str | None:
    overrides, _, _ = role_spec(job, role, policy)
    return overrides.image or job.spec.image or settings.default_image


def _resources(overrides: RoleOverrides, gpus: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if overrides.resources is not None:
        if overrides.resources.requests:
            out["requests"] = dict(overrides.resources.requests)
        if overrides.resources.limits:
            out["limits"] = dict(overrides.resources.limits)
    if gpus > 0:
        # Extended resources must have requests == limits; setting both keeps the Kueue podSet exact.
        out.setdefault("requests", {})[GPU_RESOURCE] = gpus
        out.setdefault("limits", {})[GPU_RESOURCE] = gpus
    return out


def _env(ref: JobRef, req: PodRequest, name: str, overrides: RoleOverrides) -> list[dict[str, Any]]:
    service = (
        naming.coordinator_service(ref.name)
        if req.role == "coordinator"
        else naming.workflow_service(ref.name)
        if req.role == "workflow"
        else naming.policy_service(ref.name, req.policy or "", req.role)
    )
    env: list[dict[str, Any]] = [
        {"name": "POLYRL_JOB", "value": ref.name},
        {"name": "POLYRL_NAMESPACE", "value": ref.namespace},
        {"name": "POLYRL_ROLE", "value": req.role},
        {"name": "POLYRL_POLICY", "value": req.policy or ""},
        {"name": "POLYRL_INDEX", "value": str(req.index)},
        {"name": "POLYRL_ATTEMPT", "value": str(req.attempt)},
        {"name": "POLYRL_POD_NAME", "value": name},
        {"name": "POLYRL_SERVICE", "value": f"{service}.{ref.namespace}.svc"},
        {
            "name": "POLYRL_COORDINATOR_ADDRESS",
            "value": f"{naming.coordinator_host(ref.name, ref.namespace)}:{naming.PORT_RAY_GCS}",
        },
        {"name": "POLYRL_CONFIG", "value": f"{naming.CONFIG_DIR}/{naming.CONFIG_KEY}"},
        {"name": "POLYRL_PODINFO_DIR", "value": naming.PODINFO_DIR},
        {"name": "POLYRL_HTTP_PORT", "value": str(naming.PORT_HTTP)},
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {
            "name": "RAY_AUTH_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": naming.secret(ref.name), "key": naming.TOKEN_KEY}},
        },
        *({"name": key, "value": value} for key, value in SCRATCH_ENV),
    ]
    for var in overrides.env or []:
        entry = var.to_k8s()
        env = [e for e in env if e["name"] != var.name] + [entry]
    return env


def _claim(uri: str | None) -> str | None:
    return uri.removeprefix("pvc://").partition("/")[0] if uri and uri.startswith("pvc://") else None


def claims(job: RLJob, role: Role, policy: str | None) -> dict[str, bool]:
    """PersistentVolumeClaims the pod mounts (claim -> read-only): the checkpoint claim on the
    coordinator and every trainer (each rank writes its own shard), the policy's model claim on its
    rollout engines (read-only) and trainers, the prompt data's claims on the coordinator (read-only:
    it reads spec.data and hands rows to the workflow workers)."""
    out: dict[str, bool] = {}
    model = _claim(_policy(job, policy).model.uri) if policy else None
    if model and role in ("rollout", "trainer"):
        out[model] = role == "rollout"
    data = job.spec.data
    for uri in (data.train, data.eval) if data is not None and role == "coordinator" else ():
        claim = _claim(uri)
        if claim:
            out[claim] = True
    ckpt = _claim(job.spec.checkpoint.uri)
    if ckpt and role in ("coordinator", "trainer"):
        out[ckpt] = False
    return out


def _mount_claims(
    pod_claims: dict[str, bool], container: dict[str, Any], volumes: list[dict[str, Any]]
) -> None:
    mounts = {}
    for i, (claim, read_only) in enumerate(sorted(pod_claims.items())):
        path = f"{naming.PVC_ROOT}/{claim}"
        volumes.append(
            {"name": f"pvc-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}
        )
        container["volumeMounts"].append({"name": f"pvc-{i}", "mountPath": path, "readOnly": read_only})
        mounts[claim] = path
    if mounts and not any(e["name"] == "POLYRL_PVC_MOUNTS" for e in container["env"]):
        # the runtime finds each claim's mount point here (polyrl_runtime.models.local_path)
        container["env"].append({"name": "POLYRL_PVC_MOUNTS", "value": json.dumps(mounts, sort_keys=True)})


def _storage_credentials(job: RLJob, container: dict[str, Any]) -> None:
    """Every pod of the job gets the Secret's keys as environment (AWS_ACCESS_KEY_ID, ...: what the
    runtime's storage layer reads) and the Secret's name, for its error messages. The values never
    appear in the pod spec or the RLJob."""
    secret = job.spec.storage.credentials_secret
    if not secret:
        return
    container["envFrom"] = [{"secretRef": {"name": secret}}]
    if not any(e["name"] == "POLYRL_CREDENTIALS_SECRET" for e in container["env"]):
        container["env"].append({"name": "POLYRL_CREDENTIALS_SECRET", "value": secret})


def _metrics_credentials(job: RLJob, role: str, container: dict[str, Any]) -> None:
    """The coordinator (where the metrics sinks run) gets the metrics Secret's keys as environment
    (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, ...: what the sinks' clients read); no other pod needs
    them. The values never appear in the pod spec or the RLJob."""
    secret = job.spec.metrics.credentials_secret
    if not secret or role != "coordinator":
        return
    refs = container.setdefault("envFrom", [])
    if {"secretRef": {"name": secret}} not in refs:
        refs.append({"secretRef": {"name": secret}})


def build_pod(
    job: RLJob, ref: JobRef, req: PodRequest, settings: OperatorSettings, priority: Priority | None = None
) -> Manifest:
    """The pod ``req`` names; ``priority``: the job's class as resolved for Kueue (a job with a queue)."""
    overrides, gpus, gpu_type = role_spec(job, req.role, req.policy)
    name = pod_name(ref.name, req)
    image = role_image(job, req.role, req.policy, settings)
    labels = naming.labels(ref.name, req.role, req.policy)
    labels[naming.LABEL_INDEX] = str(req.index)
    if req.role in ("coordinator", "trainer"):
        labels[naming.LABEL_ATTEMPT] = str(req.attempt)
    subdomain = (
        naming.workflow_service(ref.name)
        if req.role == "workflow"
        else naming.policy_service(ref.name, req.policy or "", req.role)
        if req.policy
        else None
    )
    config = f"{naming.CONFIG_DIR}/{naming.CONFIG_KEY}"
    if req.role == "coordinator":
        args = ["coordinator", "--config", config]
    else:
        args = ["worker", "--config", config, "--role", req.role]
        if req.policy:
            args += ["--policy", req.policy]
    container: dict[str, Any] = {
        "name": naming.CONTAINER,
        "image": image,
        "command": list(settings.runtime_command),
        "args": args,
        "env": _env(ref, req, name, overrides),
        "ports": [{"name": "http", "containerPort": naming.PORT_HTTP, "protocol": "TCP"}],
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": naming.PORT_HTTP},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "volumeMounts": [
            {"name": "config", "mountPath": naming.CONFIG_DIR, "readOnly": True},
            {"name": "podinfo", "mountPath": naming.PODINFO_DIR, "readOnly": True},
            {"name": "scratch", "mountPath": SCRATCH_DIR},
        ],
        "securityContext": container_security_context(req.role, settings),
    }
    if req.role == "coordinator":
        container["ports"] += [
            {"name": "gcs", "containerPort": naming.PORT_RAY_GCS, "protocol": "TCP"},
            {"name": "client", "containerPort": naming.PORT_RAY_CLIENT, "protocol": "TCP"},
        ]
        if job.spec.coordinator.dashboard:  # the head serves it only then (spec.coordinator.dashboard)
            container["ports"].append(
                {"name": "dashboard", "containerPort": naming.PORT_RAY_DASHBOARD, "protocol": "TCP"}
            )
    if req.role == "trainer":
        container["ports"].append(
            {"name": "rendezvous", "containerPort": naming.PORT_RENDEZVOUS, "protocol": "TCP"}
        )
    _storage_credentials(job, container)
    _metrics_credentials(job, req.role, container)
    if settings.image_pull_policy:
        container["imagePullPolicy"] = settings.image_pull_policy
    resources = _resources(overrides, gpus)
    if resources:
        container["resources"] = resources
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": naming.config_map(ref.name)}},
        {
            "name": "podinfo",
            "downwardAPI": {
                "items": [
                    {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                    {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
                ]
            },
        },
        {"name": "scratch", "emptyDir": {}},
    ]
    if gpus > 0:
        # vLLM and NCCL need a large /dev/shm; the container runtime's default is 64 MiB.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    _mount_claims(claims(job, req.role, req.policy), container, volumes)
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "hostname": name,
        # The job's own ServiceAccount, bound to no role, and no API token in the pod: job pods
        # never talk to the Kubernetes API (the operator alone writes status).
        "serviceAccountName": naming.service_account(ref.name),
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(settings),
        "containers": [container],
        "volumes": volumes,
    }
    if subdomain:
        spec["subdomain"] = subdomain
    priority_class = pod_priority_class(job, priority)
    if priority_class:
        spec["priorityClassName"] = priority_class
    for placement in (settings.placement(gpu_type) if gpus > 0 or gpu_type else None, req.flavor):
        if placement is None:
            continue
        if placement.node_selector:
            spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **placement.node_selector}
        if placement.tolerations:
            spec["tolerations"] = spec.get("tolerations", []) + [
                t for t in placement.tolerations if t not in spec.get("tolerations", [])
            ]
        if placement.affinity:
            spec["affinity"] = placement.affinity
    meta = metadata(ref, name, labels)
    template = overrides.pod_template
    if template is not None:
        if template.metadata is not None:
            if template.metadata.labels:
                meta["labels"] = {**template.metadata.labels, **meta["labels"]}
            if template.metadata.annotations:
                meta["annotations"] = dict(template.metadata.annotations)
        if template.spec:
            spec = strategic_merge(spec, template.spec)
    manifest: Manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
    return stamp_hash(manifest)
