"""What a client asked the API server, and whether RBAC rules would have let it.

The test control plane enforces no RBAC (the shim is unauthenticated and talks to the CRD server as
one admin), so the RBAC tests record the operator's real requests instead and check them against
the rules the install manifests grant:

* ``RecordingProxy``: an HTTP proxy (own thread and event loop, so sync tests can use it) in front
  of the shim; a client pointed at it (kubeconfig) is recorded request by request, watch streams
  included, and otherwise served unchanged.
* ``request_attributes``: the API server's request-info resolution (``k8s.io/apiserver``
  ``RequestInfoFactory``): method + path + query -> verb, API group, resource, subresource,
  namespace, name; or a non-resource URL (discovery).
* ``Authorizer``: the RBAC authorizer's rule matching (``plugin/pkg/auth/authorizer/rbac``) for one
  ServiceAccount, from rendered manifests: ClusterRoleBindings grant everywhere, RoleBindings only
  in their namespace (with a Role, or a ClusterRole's rules), ``resourceNames`` never match a
  create or a collection, and the default ``system:discovery`` role every authenticated user has.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import aiohttp
from aiohttp import web

HOP = {"content-length", "transfer-encoding", "connection", "content-encoding", "host", "keep-alive"}

# The bootstrap ClusterRole system:discovery (bound to system:authenticated), and the health
# endpoints of system:public-info-viewer.
DISCOVERY_URLS = ("/api", "/api/*", "/apis", "/apis/*", "/openapi", "/openapi/*", "/version", "/version/")
PUBLIC_URLS = ("/healthz", "/livez", "/readyz", "/version", "/version/")


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    query: str
    user_agent: str


@dataclass(frozen=True)
class Attributes:
    """One request as the authorizer sees it."""

    verb: str
    resource_request: bool
    path: str = ""
    api_group: str = ""
    api_version: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def grant(self) -> tuple[str, str, str]:
        """(apiGroup, resource[/subresource], verb): what a rule must name to allow it."""
        resource = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return self.api_group, resource, self.verb

    def __str__(self) -> str:
        if not self.resource_request:
            return f"{self.verb} {self.path}"
        group, resource, verb = self.grant
        where = f" in {self.namespace}" if self.namespace else " (cluster scope)"
        return f"{verb} {group or 'core'}/{resource}{' ' + self.name if self.name else ''}{where}"


def request_attributes(method: str, path: str, query: str = "") -> Attributes:
    """The API server's RequestInfoFactory, for the verbs clients use."""
    params = parse_qs(query)
    parts = [p for p in path.split("/") if p]
    method_verb = {
        "GET": "get",
        "HEAD": "get",
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete",
    }.get(method.upper(), method.lower())
    if not parts or parts[0] not in ("api", "apis"):
        return Attributes(verb=method_verb, resource_request=False, path=path)
    if parts[0] == "api":
        group, rest = "", parts[1:]
        if not rest:
            return Attributes(verb=method_verb, resource_request=False, path=path)
        version, rest = rest[0], rest[1:]
    else:
        if len(parts) < 3:
            return Attributes(verb=method_verb, resource_request=False, path=path)
        group, version, rest = parts[1], parts[2], parts[3:]
    if not rest:
        return Attributes(verb=method_verb, resource_request=False, path=path)
    verb = method_verb
    if rest[0] == "watch":  # the deprecated /watch/ path prefix
        verb, rest = "watch", rest[1:]
    namespace = ""
    if rest and rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        # /namespaces/NS/RESOURCE...: a namespaced resource; /namespaces/NAME[/status|/finalize]:
        # the Namespace object itself.
        if len(rest) > 2 and rest[2] not in ("status", "finalize"):
            rest = rest[2:]
    resource = rest[0] if rest else ""
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if not name and verb == "get":
        watch = params.get("watch", [""])[0] in ("true", "1")
        verb = "watch" if watch else "list"
    elif not name and verb == "delete":
        verb = "deletecollection"
    elif verb == "get" and params.get("watch", [""])[0] in ("true", "1"):
        verb = "watch"  # a watch of one object (fieldSelector on the name)
    return Attributes(
        verb=verb,
        resource_request=True,
        api_group=group,
        api_version=version,
        resource=resource,
        subresource=subresource,
        namespace=namespace,
        name=name,
    )


def _rule_allows(rule: dict[str, Any], attrs: Attributes) -> bool:
    verbs = rule.get("verbs") or []
    if "*" not in verbs and attrs.verb not in verbs:
        return False
    if not attrs.resource_request:
        for url in rule.get("nonResourceURLs") or []:
            if url in ("*", attrs.path) or (url.endswith("*") and attrs.path.startswith(url[:-1])):
                return True
        return False
    groups = rule.get("apiGroups")
    if groups is None or ("*" not in groups and attrs.api_group not in groups):
        return False
    resources = rule.get("resources") or []
    combined = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    allowed = (
        "*" in resources
        or combined in resources
        or (attrs.subresource and f"*/{attrs.subresource}" in resources)
        or (not attrs.subresource and attrs.resource in resources)
    )
    if not allowed:
        return False
    names = rule.get("resourceNames") or []
    if names:
        # A create (no name yet) or a collection never matches a rule limited to names.
        return bool(attrs.name) and attrs.name in names and attrs.verb != "create"
    return True


@dataclass
class Grant:
    rules: list[dict[str, Any]]
    namespace: str | None
    """None: everywhere (ClusterRoleBinding); else only requests in this namespace."""
    source: str


class Authorizer:
    """RBAC for one ServiceAccount, from a list of rendered manifests."""

    def __init__(self, manifests: Iterable[dict[str, Any]], namespace: str, name: str) -> None:
        docs = [d for d in manifests if isinstance(d, dict)]
        self.subject = (namespace, name)
        cluster_roles = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ClusterRole"}
        roles = {
            (d["metadata"].get("namespace", ""), d["metadata"]["name"]): d
            for d in docs
            if d.get("kind") == "Role"
        }
        self.grants: list[Grant] = [
            Grant([{"nonResourceURLs": list(DISCOVERY_URLS), "verbs": ["get"]}], None, "system:discovery"),
            Grant(
                [{"nonResourceURLs": list(PUBLIC_URLS), "verbs": ["get"]}], None, "system:public-info-viewer"
            ),
        ]
        self.bound: list[str] = []
        for doc in docs:
            kind = doc.get("kind")
            if kind not in ("ClusterRoleBinding", "RoleBinding") or not self._names_subject(doc):
                continue
            ref = doc["roleRef"]
            binding_ns = doc["metadata"].get("namespace", "")
            if ref["kind"] == "ClusterRole":
                role = cluster_roles.get(ref["name"])
            else:
                role = roles.get((binding_ns, ref["name"]))
            if role is None:
                raise AssertionError(f"{kind} {doc['metadata']['name']} refers to a missing {ref}")
            scope = None if kind == "ClusterRoleBinding" else binding_ns
            source = f"{kind} {doc['metadata']['name']} -> {ref['kind']} {ref['name']}"
            self.grants.append(Grant(list(role.get("rules") or []), scope, source))
            self.bound.append(source)

    def _names_subject(self, binding: dict[str, Any]) -> bool:
        namespace, name = self.subject
        binding_ns = binding["metadata"].get("namespace", "")
        for subject in binding.get("subjects") or []:
            if subject.get("kind") != "ServiceAccount" or subject.get("name") != name:
                continue
            if (subject.get("namespace") or binding_ns) == namespace:
                return True
        return False

    def allows(self, attrs: Attributes) -> str | None:
        """The binding that allows the request, or None."""
        for grant in self.grants:
            if grant.namespace is not None and (
                not attrs.resource_request or attrs.namespace != grant.namespace
            ):
                continue
            if any(_rule_allows(rule, attrs) for rule in grant.rules):
                return grant.source
        return None

    def granted(self) -> Iterator[tuple[str, tuple[str, str, str], str | None]]:
        """Every (source, (group, resource, verb), namespace) the bound roles name (no wildcards
        expected: a wildcard is yielded as it is and fails the tests' exact comparison)."""
        for grant in self.grants:
            if grant.source.startswith("system:"):
                continue
            for rule in grant.rules:
                for group in rule.get("apiGroups") or []:
                    for resource in rule.get("resources") or []:
                        for verb in rule.get("verbs") or []:
                            yield grant.source, (group, resource, verb), grant.namespace


class RecordingProxy:
    """Forward everything to ``upstream`` and record each request (method, path, query)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.requests: list[Recorded] = []
        self.url = ""
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    def __enter__(self) -> RecordingProxy:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(ready))
            except BaseException as exc:  # reported to the starting thread
                failure.append(exc)
                ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="recording-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(30) or failure:
            raise RuntimeError(f"recording proxy did not start: {failure!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)

    def snapshot(self) -> list[Recorded]:
        with self._lock:
            return list(self.requests)

    async def _serve(self, ready: threading.Event) -> None:
        self._stop = asyncio.Event()
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        app = web.Application(client_max_size=64 * 1024 * 1024)

        async def handle(request: web.Request) -> web.StreamResponse:
            with self._lock:
                self.requests.append(
                    Recorded(
                        request.method,
                        request.path,
                        request.rel_url.raw_query_string,
                        request.headers.get("User-Agent", ""),
                    )
                )
            body = await request.read()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
            async with session.request(
                request.method, f"{self.upstream}{request.rel_url}", data=body or None, headers=headers
            ) as upstream:
                response = web.StreamResponse(
                    status=upstream.status,
                    headers={k: v for k, v in upstream.headers.items() if k.lower() not in HOP},
                )
                await response.prepare(request)
                with contextlib.suppress(ConnectionError):
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
                    await response.write_eof()
                return response

        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        ready.set()
        try:
            await self._stop.wait()
        finally:
            await session.close()
            await runner.cleanup()
