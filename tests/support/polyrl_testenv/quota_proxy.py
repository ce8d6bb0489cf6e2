"""A test-side stand-in for the ResourceQuota admission plugin, which the test control plane lacks.

An HTTP proxy in front of the shim that forwards everything unchanged (watch streams included) and
refuses a pod creation exactly as the real plugin does when a namespace's pod count would exceed
``limit``: HTTP 403, reason Forbidden, message ``pods "NAME" is forbidden: exceeded quota: ...``.
The count is read from the real server at the time of the request, so the quota is as real as the
pods are. This is fault injection on the test side, documented as such; the operator under test
talks to it through an ordinary kubeconfig/server URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import aiohttp
from aiohttp import web

POD_COLLECTION = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
HOP = {"content-length", "transfer-encoding", "connection", "content-encoding", "host", "keep-alive"}


class QuotaProxy:
    def __init__(self, upstream: str, limit: int | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.limit = limit
        """Most pods per namespace; None: no quota."""
        self.refusals = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        # The real plugin serialises admissions through the quota object's resourceVersion;
        # one lock around count-then-create does the same here.
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "POST" and POD_COLLECTION.match(request.path):
            async with self._lock:
                return await self._forward(request, body, check_quota=True)
        return await self._forward(request, body, check_quota=False)

    async def _forward(self, request: web.Request, body: bytes, *, check_quota: bool) -> web.StreamResponse:
        assert self._session is not None
        if check_quota and self.limit is not None:
            async with self._session.get(f"{self.upstream}{request.path}") as resp:
                used = len((await resp.json()).get("items") or [])
            if used + 1 > self.limit:
                self.refusals += 1
                name = json.loads(body or b"{}").get("metadata", {}).get("name", "")
                message = (
                    f'pods "{name}" is forbidden: exceeded quota: test-quota, requested: pods=1, '
                    f"used: pods={used}, limited: pods={self.limit}"
                )
                status = {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": message,
                    "reason": "Forbidden",
                    "details": {"name": name, "kind": "pods"},
                    "code": 403,
                }
                return web.json_response(status, status=403)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with self._session.request(
            request.method, f"{self.upstream}{request.path_qs}", data=body or None, headers=headers
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in HOP},
            )
            await response.prepare(request)
            # A watcher hanging up mid-stream is normal; stop forwarding quietly.
            with contextlib.suppress(ConnectionError):
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            return response
