"""A small asyncio Kubernetes client on aiohttp: just the verbs apply needs (get, list, create,
patch, delete), counted per verb for the metrics and the benchmark.

Why not the official client: it is synchronous (a thread per call), and the operator already runs
on aiohttp inside kopf; an async client lets one reconcile create a job's pods in parallel with a
bounded number of requests in flight. Credentials come from the official client's loaders
(kubeconfig or in-cluster service account), so every auth form they support works here too.
PUT is deliberately absent: the operator only ever PATCHes (merge or JSON patch).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from polyrl_operator.kinds import CHILD_KINDS

PLURALS = {
    **{k.kind: k.plural for k in CHILD_KINDS},
    "Event": "events",
    "RLJob": "rljobs",
    "ResourceFlavor": "resourceflavors",
}
CHILD_API_VERSIONS = {k.kind: k.api_version for k in CHILD_KINDS}
"""apiVersion of every kind of child the operator creates (from the one table in ``kinds``)."""
CLUSTER_SCOPED = frozenset({"ResourceFlavor"})
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class ApiError(Exception):
    """A non-2xx answer from the API server, with its Status reason and message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def quota_exceeded(self) -> bool:
        """The ResourceQuota admission refusal (HTTP 403, "exceeded quota: ...")."""
        return self.status == 403 and "exceeded quota" in self.message


def path_for(
    api_version: str,
    kind: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of a kind (core kinds under /api/v1, others under /apis/GROUP/VERSION)."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    plural = PLURALS[kind]
    parts = [base]
    if namespace is not None and kind not in CLUSTER_SCOPED:
        parts.append(f"namespaces/{namespace}")
    parts.append(plural)
    if name is not None:
        parts.append(name)
    if subresource is not None:
        parts.append(subresource)
    return "/".join(parts)


@dataclass
class Credentials:
    server: str
    ssl_context: ssl.SSLContext | bool = True
    token: str | None = None
    token_file: str | None = None
    """Re-read on every request burst: in-cluster service-account tokens rotate."""
    headers: dict[str, str] = field(default_factory=dict)
    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    insecure: bool = False


def load_credentials(kubeconfig: str | None = None, context: str | None = None) -> Credentials:
    """Credentials from a kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``) or, failing that, the
    in-cluster service account, using the official client's loaders."""
    from kubernetes import client, config  # imported lazily: only the operator process needs it

    cfg = client.Configuration()
    try:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, context=context, client_configuration=cfg
        )
        token_file = None
    except (config.ConfigException, FileNotFoundError, TypeError):
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        token_file = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    context_ssl: ssl.SSLContext | bool = True
    if cfg.host.startswith("https"):
        if not cfg.verify_ssl:
            context_ssl = False
        else:
            ctx = (
                ssl.create_default_context(cafile=cfg.ssl_ca_cert)
                if cfg.ssl_ca_cert
                else ssl.create_default_context()
            )
            if cfg.cert_file and cfg.key_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
            context_ssl = ctx
    token = None
    auth = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken")
    if auth:
        prefix = cfg.api_key_prefix.get("authorization", "")
        token = auth.removeprefix("Bearer ").strip() if not prefix else auth
    return Credentials(
        server=cfg.host.rstrip("/"),
        ssl_context=context_ssl,
        token=token,
        token_file=token_file,
        ca_path=cfg.ssl_ca_cert or None,
        cert_path=cfg.cert_file or None,
        key_path=cfg.key_file or None,
        insecure=context_ssl is False,
    )


class KubeClient:
    """An aiohttp session to one API server; safe to share between concurrent reconciles."""

    def __init__(self, credentials: Credentials, *, timeout: float = 30.0) -> None:
        self.credentials = credentials
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self.requests: collections.Counter[str] = collections.Counter()
        """Requests sent, by verb (get, list, create, patch, delete)."""

    @property
    def writes(self) -> int:
        return sum(n for verb, n in self.requests.items() if verb in ("create", "patch", "delete"))

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", **self.credentials.headers}
        token = self.credentials.token
        if self.credentials.token_file:
            with contextlib.suppress(OSError):
                token = Path(self.credentials.token_file).read_text().strip()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self.credentials.ssl_context, limit=64)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            # Let the connector close its transports before the loop goes away.
            await asyncio.sleep(0)

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
        headers = self._headers()
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        session = self._get_session()
        async with session.request(
            method, self.credentials.server + path, data=data, headers=headers, params=params
        ) as resp:
            text = await resp.text()
            try:
                payload = json.loads(text) if text else {}
            except ValueError:
                payload = {"message": text}
            if resp.status >= 400:
                message = payload.get("message", text) if isinstance(payload, dict) else text
                reason = payload.get("reason", resp.reason or "") if isinstance(payload, dict) else ""
                raise ApiError(resp.status, str(reason), str(message))
            return payload if isinstance(payload, dict) else {"items": payload}

    async def get(self, path: str) -> dict[str, Any]:
        return await self.request("get", "GET", path)

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        result = await self.request("list", "GET", path, params=params)
        return list(result.get("items") or [])

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("create", "POST", path, body=body)

    async def patch(self, path: str, body: Any, content_type: str = MERGE) -> dict[str, Any]:
        return await self.request("patch", "PATCH", path, body=body, content_type=content_type)

    async def delete(self, path: str) -> dict[str, Any]:
        # Background propagation: the API server (where a collector runs) removes dependents later;
        # the operator deletes its children explicitly anyway.
        return await self.request(
            "delete",
            "DELETE",
            path,
            body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
        )


def merge_patch(old: Any, new: Any) -> Any:
    """The RFC 7386 merge patch that turns ``old`` into ``new`` (None where nothing changes)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None if old == new else new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif isinstance(value, dict) and isinstance(old[key], dict):
            sub = merge_patch(old[key], value)
            if sub:
                patch[key] = sub
        elif old[key] != value:
            patch[key] = value
    return patch
