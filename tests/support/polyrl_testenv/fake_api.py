"""An in-memory API server behind the operator's own KubeClient interface, for unit tests of the
reconciler and apply (no HTTP, no clock, no kopf): create/get/list/merge-patch/delete with uids,
resourceVersion preconditions (409), finalizers, label selectors and an optional pod quota (403).
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterator, Mapping
from typing import Any

from polyrl_operator import naming
from polyrl_operator.kube import ApiError, Credentials, KubeClient
from polyrl_operator.observed import Child, summarize

KINDS = {
    "pods": "Pod",
    "services": "Service",
    "configmaps": "ConfigMap",
    "secrets": "Secret",
    "serviceaccounts": "ServiceAccount",
    "networkpolicies": "NetworkPolicy",
    "events": "Event",
    "workloads": "Workload",
    "rljobs": "RLJob",
    "resourceflavors": "ResourceFlavor",
}


def _apply_merge(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _apply_merge(out.get(key), value)
    return out


class FakeApi(KubeClient):
    def __init__(self) -> None:
        super().__init__(Credentials(server="fake://"))
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self._rv = itertools.count(100)
        self._uid = itertools.count(1)
        self.pod_quota: int | None = None
        self.log: list[tuple[str, str]] = []

    # -- path parsing: /api/v1/namespaces/NS/PLURAL[/NAME[/SUB]] or /apis/G/V/... -----------------
    @staticmethod
    def _parse(path: str) -> tuple[str, str | None, str | None, str | None]:
        parts = path.strip("/").split("/")
        parts = parts[2:] if parts[0] == "api" else parts[3:]
        namespace = None
        if parts and parts[0] == "namespaces" and len(parts) > 2:
            namespace, parts = parts[1], parts[2:]
        plural = parts[0]
        name = parts[1] if len(parts) > 1 else None
        sub = parts[2] if len(parts) > 2 else None
        return plural, namespace, name, sub

    def _missing(self, plural: str, name: str | None) -> ApiError:
        return ApiError(404, "NotFound", f'{plural} "{name}" not found')

    async def request(
        self,
        verb: str,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        self.requests[verb] += 1
        plural, namespace, name, sub = self._parse(path)
        self.log.append((verb, f"{plural}/{name or ''}"))
        if method == "GET" and name is None:
            selector = dict(p.split("=", 1) for p in (params or {}).get("labelSelector", "").split(",") if p)
            items = [
                copy.deepcopy(o)
                for (pl, ns, _), o in sorted(self.objects.items())
                if pl == plural
                and (namespace is None or ns == namespace)
                and all((o["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
            ]
            return {"items": items}
        if method == "GET":
            obj = self.objects.get((plural, namespace, name or ""))
            if obj is None:
                raise self._missing(plural, name)
            return copy.deepcopy(obj)
        if method == "POST":
            return self._create(plural, namespace, body)
        assert name is not None
        key = (plural, namespace, name)
        obj = self.objects.get(key)
        if obj is None:
            raise self._missing(plural, name)
        if method == "PATCH":
            return self._patch(key, obj, body, sub)
        if method == "DELETE":
            return self._delete(key, obj)
        raise AssertionError(f"unexpected {method} {path}")

    def _create(self, plural: str, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        obj = json.loads(json.dumps(body))
        meta = obj.setdefault("metadata", {})
        key = (plural, namespace, meta["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f'{plural} "{meta["name"]}" already exists')
        if plural == "pods" and self.pod_quota is not None:
            used = sum(1 for (pl, ns, _) in self.objects if pl == "pods" and ns == namespace)
            if used + 1 > self.pod_quota:
                raise ApiError(
                    403,
                    "Forbidden",
                    f'pods "{meta["name"]}" is forbidden: exceeded quota: pods, requested: pods=1, '
                    f"used: pods={used}, limited: pods={self.pod_quota}",
                )
        if plural == "secrets" and "stringData" in obj:
            obj["data"] = {k: v.encode().hex() for k, v in obj.pop("stringData").items()}
        meta["namespace"] = namespace
        meta["uid"] = f"uid-{next(self._uid)}"
        meta["resourceVersion"] = str(next(self._rv))
        meta.setdefault("generation", 1)
        self.objects[key] = obj
        return copy.deepcopy(obj)

    def _patch(self, key: Any, obj: dict[str, Any], body: dict[str, Any], sub: str | None) -> dict[str, Any]:
        want_rv = (body.get("metadata") or {}).get("resourceVersion")
        if want_rv is not None and want_rv != obj["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified")
        body = copy.deepcopy(body)
        (body.get("metadata") or {}).pop("resourceVersion", None)
        if sub == "status":
            body = {"status": body.get("status")} if "status" in body else {}
        elif key[0] == "rljobs" or key[0] == "pods":
            body.pop("status", None)
        new = _apply_merge(obj, body)
        if key[0] == "rljobs" and new.get("spec") != obj.get("spec"):
            new["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
        new["metadata"]["resourceVersion"] = str(next(self._rv))
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            del self.objects[key]
        else:
            self.objects[key] = new
        return copy.deepcopy(new)

    def _delete(self, key: Any, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["metadata"].get("finalizers"):
            obj["metadata"].setdefault("deletionTimestamp", "2026-01-01T00:00:00Z")
            obj["metadata"]["resourceVersion"] = str(next(self._rv))
        else:
            del self.objects[key]
        return copy.deepcopy(obj)

    # -- test conveniences ------------------------------------------------------------------------
    def names(self, plural: str, namespace: str = "team-a") -> set[str]:
        return {n for (pl, ns, n) in self.objects if pl == plural and ns == namespace}

    def obj(self, plural: str, name: str, namespace: str = "team-a") -> dict[str, Any]:
        return self.objects[(plural, namespace, name)]

    def set_pod_status(self, name: str, status: dict[str, Any], namespace: str = "team-a") -> None:
        pod = self.objects[("pods", namespace, name)]
        pod["status"] = copy.deepcopy(status)
        pod["metadata"]["resourceVersion"] = str(next(self._rv))

    def index(self, kind: str) -> FakeIndex:
        plural = {v: k for k, v in KINDS.items()}[kind]
        return FakeIndex(self, plural, kind)


class FakeIndex(Mapping[tuple[str, str], list[Child]]):
    """What kopf's index would hold: child summaries keyed (namespace, job), always up to date."""

    def __init__(self, api: FakeApi, plural: str, kind: str) -> None:
        self.api, self.plural, self.kind = api, plural, kind

    def _all(self) -> dict[tuple[str, str], list[Child]]:
        out: dict[tuple[str, str], list[Child]] = {}
        for (pl, ns, _), obj in self.api.objects.items():
            job = (obj["metadata"].get("labels") or {}).get(naming.LABEL_JOB)
            if pl == self.plural and job:
                out.setdefault((ns or "", job), []).append(summarize(self.kind, obj))
        return out

    def __getitem__(self, key: tuple[str, str]) -> list[Child]:
        return self._all()[key]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())
