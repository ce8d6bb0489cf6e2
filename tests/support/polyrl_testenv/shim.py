"""HTTP shim in front of the genuine Kubernetes CRD server (apiextensions-apiserver).

That server has real CRD semantics but no core API group, no ``/api`` and no ``/apis`` root
discovery, so kubectl, the kubernetes client and kopf cannot use it directly. The shim (plain HTTP
on loopback, no auth) adds exactly that and otherwise proxies byte-for-byte with an admin client
certificate:

* ``/api``, ``/api/v1`` and ``/apis`` discovery, answered in the legacy format with a plain
  ``application/json`` type, so kubectl falls back from aggregated discovery;
* core kinds (Pod, Service, ConfigMap, Secret, Event, Namespace, ServiceAccount, PVC, Node) stored
  as schemaless CRDs of the hidden group ``core.shim.polyrl.dev``: ``/api/v1/...`` paths and
  ``apiVersion: v1`` are rewritten both ways, watch streams line by line without buffering; the
  same for a few built-in kinds of named groups (apps Deployment, rbac.authorization.k8s.io
  Role/ClusterRole/bindings, networking.k8s.io NetworkPolicy) under ``<group>.shim.polyrl.dev``;
* strategic merge patches on core kinds (see ``strategicpatch``), ``Content-Type`` defaulting,
  Secret ``stringData`` folding and ``status.phase: Active`` on new Namespaces.

Run it as its own process so it does not depend on the test's event loop:
``python -m polyrl_testenv.shim --upstream https://127.0.0.1:6443 --ca ca.crt --cert c.crt
--key c.key --port 0 --port-file port``; the port file appears once the core CRDs are served.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import re
import signal
import ssl
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from yarl import URL

from polyrl_testenv.corekinds import (
    BUILTIN_KINDS,
    BUILTIN_OF_PLURAL,
    GROUPS,
    INTERNAL_GROUP,
    INTERNAL_GV,
    INTERNAL_PREFIX,
    PUBLIC_PLURAL,
    SHIM_SUFFIX,
    CorePath,
    crd_manifest,
    internal_group,
    map_core_path,
    map_group_path,
    publish_gvk,
    to_internal,
    to_public,
    version_priority,
)
from polyrl_testenv.protobuf import ProtoSchema, load_schema
from polyrl_testenv.strategicpatch import apply_strategic_merge_patch

log = logging.getLogger("polyrl_testenv.shim")

BOOTSTRAP_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
# Request/response headers that belong to one hop, or that are invalid once a body is rewritten.
HOP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Transfer-Encoding", "Content-Length", "Content-Encoding",
        "Host", "Upgrade", "Proxy-Connection", "TE", "Trailer", "Authorization", "Accept-Encoding",
        "Date", "Server",
    )
)  # fmt: skip
# Kinds whose DELETE returns the object in a real cluster (ReturnDeletedObject in their registry).
RETURNS_DELETED_OBJECT = frozenset({"pods", "services", "persistentvolumeclaims", "namespaces"})


def json_response(body: Any, status: int = 200) -> web.Response:
    # Exactly application/json: kubectl then knows discovery is not the aggregated format.
    return web.Response(status=status, body=json.dumps(body).encode(), content_type="application/json")


def status_response(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
    return json_response({**body, "message": message, "reason": reason, "code": code}, status=code)


def forwarded_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in HOP_HEADERS]


class Shim:
    def __init__(self, upstream: str, ssl_context: ssl.SSLContext, proto: ProtoSchema | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.proto = proto
        self.ssl_context = ssl_context
        self._session: aiohttp.ClientSession | None = None
        self.ready = False

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No total timeout (watches last long); no connection limit (each watch holds one).
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self.ssl_context, limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def get_json(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.upstream + path) as resp:
            return resp.status, await resp.json(content_type=None)

    # ---- discovery ---------------------------------------------------------------------------

    async def api_versions(self, request: web.Request) -> web.Response:
        host = request.host or "127.0.0.1"
        return json_response(
            {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}],
            }
        )

    async def core_resources(self) -> web.Response:
        status, body = await self.get_json(INTERNAL_PREFIX)
        if status != 200:
            return status_response(503, "ServiceUnavailable", "core kinds are not served yet")
        for resource in body.get("resources", []):
            plural, _, sub = resource["name"].partition("/")
            resource["name"] = PUBLIC_PLURAL.get(plural, plural) + (f"/{sub}" if sub else "")
        body["groupVersion"] = "v1"
        return json_response(body)

    async def api_groups(self) -> web.Response:
        status, crds = await self.get_json("/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
        if status != 200:
            return status_response(503, "ServiceUnavailable", f"listing CRDs failed ({status})")
        versions: dict[str, set[str]] = {}
        for crd in crds.get("items", []):
            conditions = crd.get("status", {}).get("conditions") or []
            established = any(c["type"] == "Established" and c["status"] == "True" for c in conditions)
            group = crd["spec"]["group"]
            if established and group != INTERNAL_GROUP:
                public = group.removesuffix(SHIM_SUFFIX)  # a built-in named group: its real name
                served = {v["name"] for v in crd["spec"]["versions"] if v.get("served")}
                versions.setdefault(public, set()).update(served)
        groups = [("apiextensions.k8s.io", ["v1"])]
        groups += [(g, sorted(vs, key=version_priority)) for g, vs in sorted(versions.items()) if vs]
        items = []
        for group, names in groups:
            entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in names]
            items.append({"name": group, "versions": entries, "preferredVersion": entries[0]})
        return json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": items})

    # ---- OpenAPI v3 ----------------------------------------------------------------------------
    # kubectl needs an "api/v1" document: `apply` decides on server-side field validation by
    # finding a PATCH operation with the fieldValidation parameter for the object's kind there
    # (for custom resources it looks at the Namespace kind in api/v1). The internal group's document
    # is republished under that name with core paths and group "".

    async def openapi_root(self, request: web.Request) -> web.Response:
        async with self.session.get(
            self.upstream + "/openapi/v3", headers={"Accept": "application/json"}
        ) as up:
            if up.status != 200:
                return web.Response(status=up.status, body=await up.read(), content_type="application/json")
            root = await up.json(content_type=None)
        paths: dict[str, Any] = root.get("paths", {})
        internal = paths.pop(f"apis/{INTERNAL_GV}", None)
        paths.pop(f"apis/{INTERNAL_GROUP}", None)
        if internal:
            url = URL(internal["serverRelativeURL"])
            paths["api/v1"] = {"serverRelativeURL": str(url.with_path("/openapi/v3/api/v1"))}
        for group in GROUPS:
            paths.pop(f"apis/{internal_group(group)}", None)
            entry = paths.pop(f"apis/{internal_group(group)}/v1", None)
            if entry:
                url = URL(entry["serverRelativeURL"])
                paths[f"apis/{group}/v1"] = {
                    "serverRelativeURL": str(url.with_path(f"/openapi/v3/apis/{group}/v1"))
                }
        return json_response(root)

    async def openapi_core(self, request: web.Request, group: str = "") -> web.Response:
        """The OpenAPI v3 document of core (``api/v1``) or of a built-in named group."""
        query = request.rel_url.raw_query_string
        internal_prefix = f"/apis/{internal_group(group)}/v1"
        public_prefix = f"/apis/{group}/v1" if group else "/api/v1"
        url = URL(
            f"{self.upstream}/openapi/v3{internal_prefix}" + (f"?{query}" if query else ""), encoded=True
        )
        async with self.session.get(url, headers={"Accept": "application/json"}) as up:
            if up.status != 200:
                return web.Response(status=up.status, body=await up.read(), content_type="application/json")
            doc = await up.json(content_type=None)
        doc["paths"] = {
            key.replace(internal_prefix, public_prefix).replace("/shimnamespaces", "/namespaces"): value
            for key, value in doc.get("paths", {}).items()
        }
        publish_gvk(doc)
        return json_response(doc)

    # ---- proxy -------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        try:
            if path in ("/api", "/api/"):
                return await self.api_versions(request)
            if path in ("/api/v1", "/api/v1/"):
                return await self.core_resources()
            if path in ("/apis", "/apis/"):
                return await self.api_groups()
            if path == "/openapi/v3":
                return await self.openapi_root(request)
            if path == "/openapi/v3/api/v1":
                return await self.openapi_core(request)
            if path.startswith("/openapi/v3/apis/") and path.endswith("/v1"):
                group = path.removeprefix("/openapi/v3/apis/").removesuffix("/v1")
                if group in GROUPS:
                    return await self.openapi_core(request, group)
            if path == "/readyz":  # the CRD server alone never reports ready (no core APIs)
                if self.ready:
                    return web.Response(text="ok")
                return web.Response(status=503, text="bootstrapping")
            return await self.proxy(request)
        except aiohttp.ClientError as exc:
            log.warning("upstream error on %s %s: %r", request.method, path, exc)
            return status_response(503, "ServiceUnavailable", f"shim: upstream unreachable: {exc!r}")

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        raw_path = request.rel_url.raw_path
        query = request.rel_url.raw_query_string
        target = (
            map_core_path(raw_path[len("/api/v1/") :])
            if raw_path.startswith("/api/v1/")
            else map_group_path(raw_path)
        )
        core = target is not None  # a built-in kind (core or named group): rewritten both ways
        if target:
            raw_path = target.internal
            if target.legacy_watch:
                query = f"{query}&watch=true" if query else "watch=true"
        watch = bool(re.search(r"(^|&)watch=(true|1)(&|$)", query))
        headers = forwarded_headers(request.headers.items())
        body = await request.read() if request.body_exists else None
        if body is not None and not request.headers.get("Content-Type"):
            # The kubernetes Python client sends no Content-Type on create; the server needs one.
            headers.append(("Content-Type", "application/json"))
        content_type = dict(headers).get("Content-Type", "").split(";")[0].strip().lower()
        if target and body and content_type == "application/vnd.kubernetes.protobuf":
            try:  # typed client-go clients (kubectl create/run) send core kinds as protobuf
                if self.proto is None:
                    raise ValueError("no .proto files (run hack/controlplane/prepare.sh)")
                body = json.dumps(to_internal(self.proto.decode_body(body))).encode()
            except (ValueError, KeyError, IndexError, UnicodeDecodeError) as exc:
                message = f"shim: cannot transcode this protobuf body to JSON: {exc}"
                return status_response(415, "UnsupportedMediaType", message)
            content_type = "application/json"
            headers = [(k, v) for k, v in headers if k.lower() != "content-type"]
            headers.append(("Content-Type", content_type))
        if target and body and request.method in ("POST", "PUT", "PATCH"):
            if content_type == "application/strategic-merge-patch+json":
                return await self.strategic_patch(raw_path, query, headers, body)
            body = self.rewrite_request_body(body, content_type, target, request.method)
            if request.method == "PUT" and target.name and content_type == "application/json":
                body = await self.unconditional_update(raw_path, body)
        before: Any = None
        deletes_one = target and request.method == "DELETE" and target.name and not target.subresource
        if target and deletes_one and target.resource in RETURNS_DELETED_OBJECT:
            before = await self.get_json(raw_path)
        url = URL(self.upstream + raw_path + (f"?{query}" if query else ""), encoded=True)
        up = await self.send(request.method, url, headers, body)
        try:
            out_headers = forwarded_headers(up.headers.items())
            if watch and up.status == 200:
                return await self.stream(request, up, out_headers, core)
            data = await up.read()
            if core and up.content_type == "application/json" and data:
                obj = json.loads(data)
                if before and before[0] == 200 and up.status == 200 and obj.get("kind") == "Status":
                    # The real API server answers DELETE of these kinds with the object, and
                    # clients decode it as such (the Python client's delete_namespaced_pod).
                    obj = before[1]
                data = json.dumps(to_public(obj)).encode()
            return web.Response(status=up.status, body=data, headers=out_headers)
        finally:
            up.release()

    async def send(self, method: str, url: URL, headers: list[tuple[str, str]], body: bytes | None) -> Any:
        """One upstream request, retried while the resource's storage is "(re)initializing".

        Right after a CRD is first served its watch cache is still loading and every request gets
        429 for about a second. Real clusters do that too, but rarely where tests would see it;
        waiting here (the request was rejected unprocessed, so a retry is safe) keeps tests
        deterministic. Returns an aiohttp.ClientResponse that the caller releases.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while True:
            resp = await self.session.request(method, url, headers=headers, data=body)
            if resp.status != 429 or loop.time() > deadline:
                return resp
            if b"initializing" not in await resp.read():  # read() keeps the body for the caller
                return resp
            resp.release()
            await asyncio.sleep(0.1)

    async def stream(
        self, request: web.Request, up: aiohttp.ClientResponse, headers: list[tuple[str, str]], core: bool
    ) -> web.StreamResponse:
        """Relay a watch: one JSON event per line, each written (and flushed) as it arrives."""
        resp = web.StreamResponse(status=up.status, headers=headers)
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        pending = b""
        async for chunk in up.content.iter_any():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    await resp.write(self.rewrite_line(line, core) + b"\n")
        if pending.strip():
            await resp.write(self.rewrite_line(pending, core) + b"\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def rewrite_line(line: bytes, core: bool) -> bytes:
        if not core:
            return line
        try:
            return json.dumps(to_public(json.loads(line))).encode()
        except ValueError:  # not JSON (should not happen): pass it on as it came
            return line

    @staticmethod
    def rewrite_request_body(body: bytes, content_type: str, target: CorePath, method: str) -> bytes:
        if content_type not in (
            "application/json",
            "application/merge-patch+json",
            "application/apply-patch+yaml",
        ):
            return body  # JSON patch (a list of operations) and anything else: untouched
        try:
            obj = yaml.safe_load(body) if content_type.endswith("yaml") else json.loads(body)
        except (ValueError, yaml.YAMLError):
            return body  # let the server produce the proper 400
        if not isinstance(obj, dict):
            return body
        resource = target.resource
        if method in ("POST", "PUT") and not obj.get("kind") and resource in BUILTIN_OF_PLURAL:
            # The real API server takes the kind of a built-in object from the URL; clients rely
            # on that (the Python client with plain dicts). CRDs would answer "Kind is missing".
            builtin = BUILTIN_OF_PLURAL[resource]
            obj["apiVersion"], obj["kind"] = builtin.public_api_version, builtin.kind
        to_internal(obj)
        if resource == "secrets" and isinstance(obj.get("stringData"), dict):
            # What the real API server does for Secrets: stringData is folded into data.
            data: dict[str, Any] = obj["data"] if isinstance(obj.get("data"), dict) else {}
            for key, value in obj.pop("stringData").items():
                data[key] = base64.b64encode(str(value).encode()).decode()
            obj["data"] = data
        if resource == "namespaces" and method == "POST" and "status" not in obj:
            obj["status"] = {"phase": "Active"}
        return json.dumps(obj).encode()

    async def unconditional_update(self, path: str, body: bytes) -> bytes:
        """A PUT without ``metadata.resourceVersion`` replaces the object unconditionally on the real
        API server for built-in kinds (helm records its releases so); a CRD refuses it, so the
        current resourceVersion is filled in."""
        obj = json.loads(body)
        metadata = obj.get("metadata") if isinstance(obj, dict) else None
        if not isinstance(metadata, dict) or metadata.get("resourceVersion"):
            return body
        code, current = await self.get_json(path)
        if code == 200 and isinstance(current, dict):
            metadata["resourceVersion"] = (current.get("metadata") or {}).get("resourceVersion")
        return json.dumps(obj).encode()

    async def strategic_patch(
        self, path: str, query: str, headers: list[tuple[str, str]], body: bytes
    ) -> web.Response:
        """Emulate a strategic merge patch as read-modify-write with a resourceVersion precondition."""
        try:
            patch = json.loads(body)
        except ValueError as exc:
            return status_response(400, "BadRequest", f"invalid strategic merge patch: {exc}")
        if not isinstance(patch, dict):
            return status_response(400, "BadRequest", "a strategic merge patch must be a JSON object")
        to_internal(patch)
        pinned = bool((patch.get("metadata") or {}).get("resourceVersion"))
        headers = [(k, v) for k, v in headers if k.lower() != "content-type"]
        headers.append(("Content-Type", "application/json"))
        url = URL(self.upstream + path + (f"?{query}" if query else ""), encoded=True)
        for _ in range(20):
            async with self.session.get(URL(self.upstream + path, encoded=True)) as current:
                if current.status != 200:
                    data = json.dumps(to_public(await current.json(content_type=None))).encode()
                    return web.Response(status=current.status, body=data, content_type="application/json")
                original = await current.json()
            try:
                merged = apply_strategic_merge_patch(original, patch)
            except ValueError as exc:
                return status_response(422, "Invalid", str(exc))
            async with self.session.put(url, headers=headers, data=json.dumps(merged).encode()) as up:
                result = await up.json(content_type=None)
                if up.status == 409 and not pinned:
                    continue  # someone wrote in between: re-read and re-apply, as the server would
                out = forwarded_headers(up.headers.items())
                return web.Response(
                    status=up.status, body=json.dumps(to_public(result)).encode(), headers=out
                )
        return status_response(409, "Conflict", "shim: strategic merge patch kept conflicting")

    # ---- bootstrap ---------------------------------------------------------------------------

    async def bootstrap(self, timeout: float = 90.0) -> None:
        """Wait for the server, create the core-kind CRDs and the standard namespaces."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        async def until(what: str, check: Any) -> None:
            while True:
                try:
                    if await check():
                        return
                except aiohttp.ClientError:
                    pass
                if loop.time() > deadline:
                    raise TimeoutError(f"shim bootstrap: timed out waiting for {what}")
                await asyncio.sleep(0.1)

        async def healthy() -> bool:
            async with self.session.get(self.upstream + "/healthz") as resp:
                return resp.status == 200

        await until("the CRD server's /healthz", healthy)
        crd_url = self.upstream + "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        for kind in BUILTIN_KINDS:
            async with self.session.post(crd_url, json=crd_manifest(kind)) as resp:
                if resp.status not in (201, 409):
                    raise RuntimeError(f"creating the CRD for {kind.kind}: {resp.status} {await resp.text()}")

        async def served() -> bool:
            for group in {kind.internal_group for kind in BUILTIN_KINDS}:
                try:
                    status, body = await self.get_json(f"/apis/{group}/v1")
                except ValueError:  # "404 page not found" (plain text) until the group is served
                    return False
                names = {r["name"] for r in body.get("resources", [])} if status == 200 else set()
                if not all(k.internal_plural in names for k in BUILTIN_KINDS if k.internal_group == group):
                    return False
            return True

        await until("the built-in-kind CRDs to be served", served)

        async def listable() -> bool:  # first requests load each watch cache (429 meanwhile)
            for kind in BUILTIN_KINDS:
                status, _ = await self.get_json(
                    f"/apis/{kind.internal_group}/v1/{kind.internal_plural}?limit=1"
                )
                if status != 200:
                    return False
            return True

        await until("the core kinds' storage to initialize", listable)
        for name in BOOTSTRAP_NAMESPACES:
            obj = {"apiVersion": INTERNAL_GV, "kind": "Namespace", "metadata": {"name": name}}
            obj["status"] = {"phase": "Active"}
            async with self.session.post(self.upstream + INTERNAL_PREFIX + "/shimnamespaces", json=obj) as r:
                if r.status not in (201, 409):
                    raise RuntimeError(f"creating namespace {name}: {r.status} {await r.text()}")
        self.ready = True


async def serve(args: argparse.Namespace) -> None:
    context = ssl.create_default_context(cafile=args.ca)
    context.load_cert_chain(args.cert, args.key)
    shim = Shim(args.upstream, context, load_schema(Path(args.proto_dir)) if args.proto_dir else None)
    # handler_cancellation: a client that goes away ends its watch, and the upstream watch with it.
    # shutdown_timeout: open watches would otherwise hold the exit for a minute.
    runner = web.AppRunner(shim.make_app(), handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    log.info("shim listening on http://%s:%d -> %s", args.host, port, args.upstream)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await shim.bootstrap()
        if args.port_file:  # written last, atomically: its presence means "ready"
            tmp = Path(f"{args.port_file}.tmp")
            tmp.write_text(str(port))
            os.replace(tmp, args.port_file)
        log.info("shim ready")
        await stop.wait()
    finally:
        await shim.close()  # ends the upstream side of open watches first
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m polyrl_testenv.shim", description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", required=True, help="https URL of apiextensions-apiserver")
    parser.add_argument("--ca", required=True, help="CA that signed the server certificate")
    parser.add_argument("--cert", required=True, help="client certificate (O=system:masters)")
    parser.add_argument("--key", required=True, help="client key")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--port-file", help="written with the port once the shim is ready")
    parser.add_argument("--proto-dir", help="Kubernetes generated.proto files, to accept protobuf bodies")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
