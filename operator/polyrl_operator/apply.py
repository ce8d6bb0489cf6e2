"""Execute a plan against the API server: create what is missing, patch what drifted, delete what is
surplus. Idempotent and safe to kill at any line: every object has a stable name, so a rerun finds
what the last run created (409 on create means "already there"; 404 on delete means "already gone").

Writes are PATCHes (JSON merge) or creates/deletes, never PUT, so fields other controllers or the
API server set are never overwritten. Pods are not patched in place (their spec is immutable): a pod
whose hash differs is deleted and recreated on the next pass, once its name is free.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from polyrl_operator import naming
from polyrl_operator.builders.common import Manifest
from polyrl_operator.kinds import child_kind
from polyrl_operator.kube import ApiError, KubeClient, merge_patch, path_for
from polyrl_operator.observed import Child
from polyrl_operator.planning import Plan

log = structlog.get_logger("polyrl.apply")


@dataclass
class ApplyResult:
    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    quota_error: str | None = None
    quota_required: bool = False
    """The refused pod was one the job cannot run without (all-or-nothing rollback needed)."""
    errors: list[str] = field(default_factory=list)
    rejected: str | None = None
    """Why the API server refused (422) a child rendered from the spec: the spec cannot run as written."""

    @property
    def writes(self) -> int:
        return len(self.created) + len(self.patched) + len(self.deleted)


def _path(kind: str, namespace: str, name: str | None = None) -> str:
    return path_for(child_kind(kind).api_version, kind, namespace, name)


def _metadata_patch(child: Child | None, manifest: Manifest) -> dict[str, Any]:
    meta = manifest["metadata"]
    return {
        "metadata": {
            "labels": meta.get("labels") or {},
            "annotations": meta.get("annotations") or {},
            "ownerReferences": meta.get("ownerReferences") or [],
        }
    }


class Applier:
    """One pass of apply for one job."""

    def __init__(self, client: KubeClient, namespace: str, *, concurrency: int) -> None:
        self.client = client
        self.namespace = namespace
        self.sem = asyncio.Semaphore(max(concurrency, 1))
        self.result = ApplyResult()

    async def _bounded(self, fn: Callable[[], Awaitable[None]]) -> None:
        async with self.sem:
            await fn()

    async def _gather(self, calls: list[Callable[[], Awaitable[None]]]) -> None:
        await asyncio.gather(*(self._bounded(c) for c in calls))

    async def create(self, manifest: Manifest) -> None:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        body = manifest
        if kind == "Secret":
            # Drawn here, once: the Secret is never rewritten, so the token is stable for the job's life.
            body = {**manifest, "stringData": {naming.TOKEN_KEY: secrets.token_urlsafe(32)}}
        try:
            await self.client.create(_path(kind, self.namespace), body)
            self.result.created.append(f"{kind}/{name}")
        except ApiError as exc:
            if exc.status == 409:
                return  # created by an earlier pass the index has not shown us yet
            if exc.quota_exceeded:
                self.result.quota_error = exc.message
                return
            if exc.status == 422:
                self._rejected(kind, name, exc)
                return
            raise

    def _rejected(self, kind: str, name: str, exc: ApiError) -> None:
        if self.result.rejected is None:
            self.result.rejected = f"the API server refused {kind} {name}: {exc.message}"

    async def delete(self, kind: str, name: str) -> None:
        try:
            await self.client.delete(_path(kind, self.namespace, name))
            self.result.deleted.append(f"{kind}/{name}")
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def patch(self, kind: str, name: str, body: dict[str, Any]) -> None:
        try:
            await self.client.patch(_path(kind, self.namespace, name), body)
            self.result.patched.append(f"{kind}/{name}")
        except ApiError as exc:
            if exc.status == 422:
                self._rejected(kind, name, exc)
            elif exc.status != 404:
                raise


async def apply_plan(
    client: KubeClient,
    plan: Plan,
    children: list[Child],
    *,
    concurrency: int = 8,
) -> ApplyResult:
    """Bring the job's children to ``plan.desired`` (+ ``plan.keep``), given what is observed."""
    applier = Applier(client, plan.ref.namespace, concurrency=concurrency)
    uid = plan.ref.uid
    observed: dict[tuple[str, str], Child] = {}
    foreign: list[Child] = []
    for child in children:
        if child.owner_uid == uid:
            observed[(child.kind, child.name)] = child
        else:
            foreign.append(child)  # left by an earlier job of the same name: not ours to keep
    occupied = {(c.kind, c.name) for c in children}

    deletes: list[tuple[str, str]] = []
    patches: list[tuple[str, str, dict[str, Any]]] = []
    creates: list[Manifest] = []
    for child in foreign:
        if not child.deleting:
            deletes.append((child.kind, child.name))
    for key, child in observed.items():
        if child.deleting or key in plan.keep:
            continue
        manifest = plan.desired.get(key)
        if manifest is None:
            deletes.append(key)
            continue
        want_hash = manifest["metadata"]["annotations"][naming.ANNOTATION_HASH]
        if child.spec_hash != want_hash:
            if child.kind in ("Pod", "Workload"):
                # Immutable (pod spec; podSets once Kueue reserved quota): replace, next pass creates.
                deletes.append(key)
            elif child.kind == "Secret":
                patches.append((child.kind, child.name, _metadata_patch(child, manifest)))
            else:
                body = _metadata_patch(child, manifest)
                # Everything the operator owns besides metadata: spec, data, and top-level fields
                # such as a ServiceAccount's automountServiceAccountToken.
                for part, value in manifest.items():
                    if part not in ("apiVersion", "kind", "metadata", "status"):
                        body[part] = value
                patches.append((child.kind, child.name, body))
        elif child.kind == "Workload" and child.active != manifest["spec"].get("active", True):
            patches.append((child.kind, child.name, {"spec": {"active": manifest["spec"]["active"]}}))
    for key, manifest in plan.desired.items():
        if key not in occupied:
            creates.append(manifest)
    for pod, wanted in plan.annotate.items():
        target = observed.get(("Pod", pod))
        if target is None or target.deleting:
            continue
        current = dict(target.annotations)
        change = {k: v for k, v in wanted.items() if current.get(k) != v}
        if change and ("Pod", pod) not in deletes:
            patches.append(("Pod", pod, {"metadata": {"annotations": change}}))

    # Deletes first (they free quota and names), then patches, then creates: infrastructure
    # (config, secret, services, workload) before pods, required pods before optional ones.
    await applier._gather([_call(applier.delete, kind, name) for kind, name in deletes])
    await applier._gather([_call(applier.patch, kind, name, body) for kind, name, body in patches])
    infra = [m for m in creates if m["kind"] != "Pod"]
    await applier._gather([_call(applier.create, m) for m in infra])
    if applier.result.rejected is not None:
        return applier.result  # no pods for a job that is invalid: the next plan removes the rest
    required = [m for m in creates if m["kind"] == "Pod" and m["metadata"]["name"] in plan.required_pods]
    optional = [m for m in creates if m["kind"] == "Pod" and m["metadata"]["name"] not in plan.required_pods]
    await applier._gather([_call(applier.create, m) for m in required])
    if applier.result.quota_error is not None:
        applier.result.quota_required = True
        return applier.result
    await applier._gather([_call(applier.create, m) for m in optional])
    return applier.result


async def delete_pods(
    client: KubeClient, namespace: str, names: list[str], *, concurrency: int = 8
) -> list[str]:
    """Delete the named pods (404 is fine): the all-or-nothing rollback after a quota refusal."""
    applier = Applier(client, namespace, concurrency=concurrency)
    await applier._gather([_call(applier.delete, "Pod", name) for name in names])
    return applier.result.deleted


def _call(fn: Callable[..., Awaitable[None]], *args: Any) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        await fn(*args)

    return run


def patch_for_status(
    old: dict[str, Any], new: dict[str, Any], resource_version: str | None
) -> dict[str, Any] | None:
    """The status merge patch (None when nothing changed), guarded by resourceVersion so a status
    computed from a stale view of the job is refused (409) instead of overwriting newer facts."""
    diff = merge_patch(old, new)
    if not diff:
        return None
    body: dict[str, Any] = {"status": diff}
    if resource_version:
        body["metadata"] = {"resourceVersion": resource_version}
    return body
