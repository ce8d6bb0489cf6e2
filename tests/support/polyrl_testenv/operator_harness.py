"""Run the polyrl operator in-process (kopf.operator as an asyncio task) against any API server URL:
kmock's emulator in the fast tier, the shim of the real control plane in the control-plane tier.

Also a tiny fake coordinator that serves recorded ``/progress`` documents per job, standing in for
the runtime's HTTP server (the operator reaches it through ``settings.progress_url``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import kopf
from aiohttp import web

from polyrl_operator.handlers import build_registry
from polyrl_operator.kube import Credentials, KubeClient
from polyrl_operator.metrics import Metrics
from polyrl_operator.reconciling import Reconciler
from polyrl_operator.settings import OperatorSettings


@dataclass
class RunningOperator:
    reconciler: Reconciler
    client: KubeClient
    """The operator's own client (its request counters are the operator's API usage)."""
    task: asyncio.Task[None]
    stop_flag: asyncio.Event


@contextlib.asynccontextmanager
async def operator_in_process(
    server: str,
    settings: OperatorSettings,
    *,
    namespaces: list[str] | None = None,
) -> AsyncIterator[RunningOperator]:
    credentials = Credentials(server=server.rstrip("/"))
    client = KubeClient(credentials)
    reconciler = Reconciler(client, settings, Metrics())
    registry = build_registry(reconciler, credentials=credentials)
    kopf_settings = kopf.OperatorSettings()
    kopf_settings.scanning.disabled = False
    kopf_settings.posting.enabled = False
    kopf_settings.watching.reconnect_backoff = 0.2
    stop_flag = asyncio.Event()
    ready_flag = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry,
            settings=kopf_settings,
            clusterwide=not namespaces,
            namespaces=namespaces or (),
            standalone=True,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    )
    try:
        await asyncio.wait_for(ready_flag.wait(), 30)
        yield RunningOperator(reconciler, client, task, stop_flag)
    finally:
        stop_flag.set()
        try:
            await asyncio.wait_for(task, 30)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()
        await reconciler.close()
        await client.close()


async def eventually(
    check: Callable[[], Awaitable[Any]], *, timeout: float = 30.0, interval: float = 0.05
) -> Any:
    """Poll ``check`` until it returns a truthy value (or raise with its last result).

    The timeout only bounds a hung test; nothing asserts how fast the operator is."""
    last: Any = None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            last = await check()
        except AssertionError as exc:
            last = exc
        else:
            if last:
                return last
        if loop.time() > deadline:
            if isinstance(last, AssertionError):
                raise last
            raise AssertionError(f"condition not met within {timeout}s; last: {last!r}")
        await asyncio.sleep(interval)


@dataclass
class FakeCoordinator:
    """Serves ``GET /{namespace}/{job}/progress`` from ``documents`` (the runtime's role in tests)."""

    documents: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    hits: dict[tuple[str, str], int] = field(default_factory=dict)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{namespace}/{job}/progress", self._progress)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/{{namespace}}/{{job}}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _progress(self, request: web.Request) -> web.Response:
        key = (request.match_info["namespace"], request.match_info["job"])
        self.hits[key] = self.hits.get(key, 0) + 1
        doc = self.documents.get(key)
        if doc is None:
            return web.Response(status=503, text="not started")
        return web.Response(text=json.dumps(doc), content_type="application/json")
