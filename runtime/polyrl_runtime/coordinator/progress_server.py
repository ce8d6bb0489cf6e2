"""HTTP for the operator and for people: `GET /healthz`, `GET /progress` (schema
`polyrl_operator.api.progress.Progress`), `POST /checkpoint` ({"requestId": ...}, idempotent by id)
and `POST /drain` ({"target": pod-or-engine, "draining": true}) for local use."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from aiohttp import web

from polyrl_operator.api.progress import CheckpointRequest
from polyrl_operator.pod_contract import PORT_HTTP
from polyrl_runtime.coordinator.driver import Driver

log = structlog.get_logger(__name__)


class ProgressServer:
    def __init__(self, driver: Driver, host: str = "0.0.0.0", port: int = PORT_HTTP) -> None:
        self.driver = driver
        self.host, self.port = host, port
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.served = 0  # /progress answers so far

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/progress", self._progress)
        app.router.add_post("/checkpoint", self._checkpoint)
        app.router.add_post("/drain", self._drain)
        return app

    async def start(self) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info("progress.listening", port=self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _progress(self, _: web.Request) -> web.Response:
        response = web.json_response(self.driver.progress().to_wire())
        self.served += 1
        return response

    async def _checkpoint(self, request: web.Request) -> web.Response:
        try:
            body = CheckpointRequest.model_validate(await request.json())
        except Exception as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)
        task = asyncio.create_task(self.driver.checkpoint(body.reason, body.request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return web.json_response({"accepted": body.request_id}, status=202)

    async def _drain(self, request: web.Request) -> web.Response:
        body = await request.json()
        found = await self.driver.set_draining(str(body.get("target", "")), bool(body.get("draining", True)))
        return web.json_response({"found": found}, status=200 if found else 404)
