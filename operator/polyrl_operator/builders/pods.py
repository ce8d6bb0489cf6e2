"""Role pods: coordinator, workflow workers, per policy rollout engines and trainers, and the pods
of each device pool.

Bare pods with stable names (``<job>-<policy>-<role>-<i>``, ``<job>-pool-<pool>-<i>``) so the operator
picks which replica to drain or replace. The container is always named ``main`` and runs the
runtime's entry points (``polyrl-runtime coordinator --config FILE`` on the coordinator,
``polyrl-runtime worker --config FILE --role ROLE [--policy NAME | --pool NAME]`` everywhere else);
everything else the runtime needs arrives as env, the config file and the downward-API volume, as
written down in docs/runtime-contract.md.

A pool pod (role ``pool``) hosts the rollouts and trainers placed on its pool: it gets the pool's
GPUs, image, resources, env and podTemplate, lists the roles it hosts in ``polyrl.dev/serves``, and
mounts and exposes what each of those roles would on a pod of its own (``RoleSlot.traits_at``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from polyrl_operator import naming
from polyrl_operator import pod_contract as contract
from polyrl_operator.api import Policy, RLJob, RoleOverrides
from polyrl_operator.builders.common import JobRef, Manifest, metadata, stamp_hash
from polyrl_operator.builders.merge import strategic_merge
from polyrl_operator.builders.priority import Priority, pod_priority_class
from polyrl_operator.builders.security import container_security_context, pod_security_context
from polyrl_operator.roles import ROLE_TRAITS, ModelMount, Role, RoleTraits, role_slot
from polyrl_operator.settings import GPU_RESOURCE, OperatorSettings, Placement


@dataclass(frozen=True)
class PodRequest:
    """Which pod to build."""

    role: Role
    index: int = 0
    policy: str | None = None
    attempt: int = 0
    """Restart attempt (status.restarts) the pod belongs to; used for the pods a restart of the job
    recreates (coordinator, trainers, pool pods hosting a trainer)."""
    flavor: Placement | None = None
    """Node placement from the Kueue admission (ResourceFlavor nodeLabels/tolerations)."""
    pool: str | None = None
    """The pool of a pool pod (role ``pool``)."""

    @property
    def owner(self) -> str | None:
        """The policy of a per-policy pod, the pool of a pool pod, None for the job's own roles."""
        return self.pool if ROLE_TRAITS[self.role].per_pool else self.policy


def pod_name(job: str, req: PodRequest) -> str:
    traits = ROLE_TRAITS[req.role]
    assert req.policy is not None or not traits.per_policy, "a per-policy pod names its policy"
    assert req.pool is not None or not traits.per_pool, "a pool pod names its pool"
    return naming.role_pod(job, req.role, req.owner, req.index)


def _policy(job: RLJob, name: str | None) -> Policy:
    for p in job.spec.policies:
        if p.name == name:
            return p
    raise KeyError(f"no policy {name!r} in job {job.metadata.name}")


def role_image(job: RLJob, role: Role, owner: str | None, settings: OperatorSettings) -> str | None:
    """The image of a role's pods (``owner``: its policy, or its pool for a pool)."""
    overrides = role_slot(job, role, owner).overrides
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
    service = naming.role_service(ref.name, req.role, req.owner)
    # POLYRL_POOL only on pool pods: the other pods' environment (and so their hash) stays as it is.
    pooled = req.pool is not None and ROLE_TRAITS[req.role].per_pool
    pool = [{"name": contract.ENV_POOL, "value": req.pool}] if pooled else []
    env: list[dict[str, Any]] = [
        {"name": contract.ENV_JOB, "value": ref.name},
        {"name": contract.ENV_NAMESPACE, "value": ref.namespace},
        {"name": contract.ENV_ROLE, "value": req.role},
        {"name": contract.ENV_POLICY, "value": req.policy or ""},
        *pool,
        {"name": contract.ENV_INDEX, "value": str(req.index)},
        {"name": contract.ENV_ATTEMPT, "value": str(req.attempt)},
        {"name": contract.ENV_POD_NAME, "value": name},
        {"name": contract.ENV_SERVICE, "value": f"{service}.{ref.namespace}.svc"},
        {
            "name": contract.ENV_COORDINATOR_ADDRESS,
            "value": f"{naming.coordinator_host(ref.name, ref.namespace)}:{contract.PORT_RAY_GCS}",
        },
        {"name": contract.ENV_CONFIG, "value": contract.CONFIG_PATH},
        {"name": contract.ENV_PODINFO_DIR, "value": contract.PODINFO_DIR},
        {"name": contract.ENV_HTTP_PORT, "value": str(contract.PORT_HTTP)},
        {"name": contract.ENV_RAY_AUTH_MODE, "value": contract.RAY_AUTH_MODE_TOKEN},
        {
            "name": contract.ENV_RAY_AUTH_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": naming.secret(ref.name), "key": naming.TOKEN_KEY}},
        },
        *({"name": key, "value": value} for key, value in contract.SCRATCH_ENV),
    ]
    for var in overrides.env or []:
        entry = var.to_k8s()
        env = [e for e in env if e["name"] != var.name] + [entry]
    return env


def _claim(uri: str | None) -> str | None:
    return uri.removeprefix("pvc://").partition("/")[0] if uri and uri.startswith("pvc://") else None


def claims(job: RLJob, role: Role, owner: str | None, index: int = 0) -> dict[str, bool]:
    """PersistentVolumeClaims the pod mounts (claim -> read-only): the checkpoint claim on the
    coordinator and every trainer (each rank writes its own shard), the policy's model claim on its
    rollout engines (read-only) and trainers, the prompt data's claims on the coordinator (read-only:
    it reads spec.data and hands rows to the workflow workers). Pool pod ``index`` mounts what each
    role it hosts would: the model claim of every policy it hosts a role of (writable when it hosts
    that policy's trainer), the checkpoint claim when it hosts a trainer. A claim two of these name
    is mounted writable when either needs it."""
    traits = ROLE_TRAITS[role]
    models: list[tuple[str, ModelMount]] = []
    if traits.per_pool:
        slot = role_slot(job, role, owner)
        traits = slot.traits_at(index)
        models = [(r.policy, ROLE_TRAITS[r.role].model_mount) for r in slot.hosted(index)]
    elif traits.per_policy and owner:
        models = [(owner, traits.model_mount)]
    out: dict[str, bool] = {}

    def mount(claim: str | None, read_only: bool) -> None:
        if claim:
            out[claim] = out.get(claim, True) and read_only

    for policy, how in models:
        if how != "none":
            mount(_claim(_policy(job, policy).model.uri), how == "read-only")
    data = job.spec.data
    for uri in (data.train, data.eval) if data is not None and traits.mounts_data else ():
        mount(_claim(uri), True)
    if traits.mounts_checkpoint:
        mount(_claim(job.spec.checkpoint.uri), False)
    return out


def _mount_claims(
    pod_claims: dict[str, bool], container: dict[str, Any], volumes: list[dict[str, Any]]
) -> None:
    mounts = {}
    for i, (claim, read_only) in enumerate(sorted(pod_claims.items())):
        path = f"{contract.PVC_ROOT}/{claim}"
        volumes.append(
            {"name": f"pvc-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}
        )
        container["volumeMounts"].append({"name": f"pvc-{i}", "mountPath": path, "readOnly": read_only})
        mounts[claim] = path
    if mounts and not any(e["name"] == contract.ENV_PVC_MOUNTS for e in container["env"]):
        # the runtime finds each claim's mount point here (polyrl_runtime.storage.local_path)
        value = json.dumps(mounts, sort_keys=True)
        container["env"].append({"name": contract.ENV_PVC_MOUNTS, "value": value})


def _storage_credentials(job: RLJob, container: dict[str, Any]) -> None:
    """Every pod of the job gets the Secret's keys as environment (AWS_ACCESS_KEY_ID, ...: what the
    runtime's storage layer reads) and the Secret's name, for its error messages. The values never
    appear in the pod spec or the RLJob."""
    secret = job.spec.storage.credentials_secret
    if not secret:
        return
    container["envFrom"] = [{"secretRef": {"name": secret}}]
    if not any(e["name"] == contract.ENV_CREDENTIALS_SECRET for e in container["env"]):
        container["env"].append({"name": contract.ENV_CREDENTIALS_SECRET, "value": secret})


def _metrics_credentials(job: RLJob, traits: RoleTraits, container: dict[str, Any]) -> None:
    """The role that runs the metrics sinks (the coordinator) gets the metrics Secret's keys as
    environment (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, ...: what the sinks' clients read); no other
    pod needs them. The values never appear in the pod spec or the RLJob."""
    secret = job.spec.metrics.credentials_secret
    if not secret or not traits.metrics_sinks:
        return
    refs = container.setdefault("envFrom", [])
    if {"secretRef": {"name": secret}} not in refs:
        refs.append({"secretRef": {"name": secret}})


def build_pod(
    job: RLJob, ref: JobRef, req: PodRequest, settings: OperatorSettings, priority: Priority | None = None
) -> Manifest:
    """The pod ``req`` names; ``priority``: the job's class as resolved for Kueue (a job with a queue)."""
    slot = role_slot(job, req.role, req.owner)
    traits = slot.traits_at(req.index)
    overrides, gpus, gpu_type = slot.overrides, slot.gpus, slot.gpu_type
    name = pod_name(ref.name, req)
    image = role_image(job, req.role, req.owner, settings)
    labels = naming.labels(ref.name, req.role, req.owner)
    labels[naming.LABEL_INDEX] = str(req.index)
    if traits.restarts_job:
        labels[naming.LABEL_ATTEMPT] = str(req.attempt)
    hosted = slot.hosted(req.index)
    annotations = {naming.ANNOTATION_SERVES: ",".join(map(str, hosted))} if hosted else {}
    shared = [b for b in job.spec.shared_bases() if req.pool is not None and b.pool == req.pool]
    if hosted and shared:
        annotations[naming.ANNOTATION_SHARED_BASES] = "; ".join(
            f"{','.join(b.policies)} on {b.model_uri} ({b.dtype})" for b in shared
        )
    # Pods of a role with a headless Service get stable DNS names under it (rank rendezvous).
    subdomain = None if traits.singleton else naming.role_service(ref.name, req.role, req.owner)
    args = [traits.entry_point, "--config", contract.CONFIG_PATH]
    if traits.entry_point == "worker":
        args += ["--role", req.role]
        if req.policy:
            args += ["--policy", req.policy]
        if req.pool and traits.per_pool:
            args += ["--pool", req.pool]
    container: dict[str, Any] = {
        "name": naming.CONTAINER,
        "image": image,
        "command": list(settings.runtime_command),
        "args": args,
        "env": _env(ref, req, name, overrides),
        "ports": [{"name": "http", "containerPort": contract.PORT_HTTP, "protocol": "TCP"}],
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": contract.PORT_HTTP},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "volumeMounts": [
            {"name": "config", "mountPath": contract.CONFIG_DIR, "readOnly": True},
            {"name": "podinfo", "mountPath": contract.PODINFO_DIR, "readOnly": True},
            {"name": "scratch", "mountPath": contract.SCRATCH_DIR},
        ],
        "securityContext": container_security_context(req.role, settings),
    }
    if traits.ray_head:
        container["ports"] += [
            {"name": "gcs", "containerPort": contract.PORT_RAY_GCS, "protocol": "TCP"},
            {"name": "client", "containerPort": contract.PORT_RAY_CLIENT, "protocol": "TCP"},
        ]
        if job.spec.coordinator.dashboard:  # the head serves it only then (spec.coordinator.dashboard)
            container["ports"].append(
                {"name": "dashboard", "containerPort": contract.PORT_RAY_DASHBOARD, "protocol": "TCP"}
            )
    if traits.rendezvous:
        container["ports"].append(
            {"name": "rendezvous", "containerPort": contract.PORT_RENDEZVOUS, "protocol": "TCP"}
        )
    _storage_credentials(job, container)
    _metrics_credentials(job, traits, container)
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
                    {"path": contract.PODINFO_LABELS, "fieldRef": {"fieldPath": "metadata.labels"}},
                    {
                        "path": contract.PODINFO_ANNOTATIONS,
                        "fieldRef": {"fieldPath": "metadata.annotations"},
                    },
                ]
            },
        },
        {"name": "scratch", "emptyDir": {}},
    ]
    if gpus > 0:
        # vLLM and NCCL need a large /dev/shm; the container runtime's default is 64 MiB.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    _mount_claims(claims(job, req.role, req.owner, req.index), container, volumes)
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
    meta = metadata(ref, name, labels, annotations)
    template = overrides.pod_template
    if template is not None:
        if template.metadata is not None:
            if template.metadata.labels:
                meta["labels"] = {**template.metadata.labels, **meta["labels"]}
            if template.metadata.annotations:
                meta["annotations"] = {**template.metadata.annotations, **meta.get("annotations", {})}
        if template.spec:
            spec = strategic_merge(spec, template.spec)
    manifest: Manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
    return stamp_hash(manifest)
