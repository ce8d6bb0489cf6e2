"""The test kubelet's Service proxy: how the operator, which is not a pod, reaches a Service of pods
that run as local processes, at `http://127.0.0.1:<port>/<namespace>/<service>/<port>/<path>`.

A pod that answers slowly (a coordinator busy starting its Ray head on a loaded machine) is a fact to
report, not a crash of the proxy. When the pod does not answer within `timeout_s`, or answers after
its client gave up (the operator reads `/progress` with a 3 s timeout), the proxy logs one line
naming the pod, the request and how long it took, and keeps it in `slow`; a client or a pod that
went away never prints a traceback. A pod that is not listening (yet, or any more) is answered 502,
as a Service without a ready endpoint would be, and not logged: the operator polls pods that start.
"""

from __future__ import annotations

import http.client
import logging
import select
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("polyrl_testenv.kubelet")

Resolve = Callable[[str, str, str], tuple[str, str] | None]
"""(namespace, service, port) -> (the `host:port` a pod of the service listens on, that pod's
`<namespace>/<name>`), or None when the service has no endpoint."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError | TimeoutError):  # the client went away mid-request
            log.info("proxy client %s went away: %s", client_address, type(error).__name__)
            return
        super().handle_error(request, client_address)  # a bug of the proxy: with its traceback


class ServiceProxy:
    def __init__(self, resolve: Resolve, *, timeout_s: float = 10.0) -> None:
        self.resolve, self.timeout_s = resolve, timeout_s
        self.slow: list[str] = []  # one line per slow answer, as logged
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self.port = int(self._server.server_address[1])

    def start(self) -> ServiceProxy:
        threading.Thread(target=self._server.serve_forever, name="test-kubelet-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _report(self, line: str) -> None:
        self.slow.append(line)
        log.warning("%s", line)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Proxy(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                parts = self.path.lstrip("/").split("/", 3)
                found = proxy.resolve(*parts[:3]) if len(parts) == 4 else None
                if found is None:
                    self._answer(502, f"no endpoint for {self.path}")
                    return
                target, pod = found
                request = f"{self.command} /{parts[3]}"
                what = f"pod {pod} (service {parts[1]} port {parts[2]})"
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
                req = urllib.request.Request(f"http://{target}/{parts[3]}", body, method=self.command)
                req.add_header("Content-Type", self.headers.get("Content-Type") or "application/json")
                start = time.monotonic()
                try:
                    with urllib.request.urlopen(req, timeout=proxy.timeout_s) as r:
                        code, data = r.status, r.read()
                except urllib.error.HTTPError as e:
                    code, data = e.code, e.read()
                except (OSError, http.client.HTTPException) as e:
                    reason = e.reason if isinstance(e, urllib.error.URLError) else e
                    if isinstance(reason, TimeoutError):
                        took = time.monotonic() - start
                        proxy._report(f"slow pod: {what} did not answer {request} within {took:.1f} s")
                        self._answer(504, f"{what} did not answer {request} within {took:.1f} s")
                    else:
                        self._answer(502, f"{what}: {reason}")
                    return
                if not self._answer(code, data):
                    took = time.monotonic() - start
                    proxy._report(
                        f"slow pod: {what} answered {request} after {took:.1f} s, when its client "
                        "had already given up"
                    )

            def _client_gone(self) -> bool:
                """The client closed the connection (timed out): end of stream, nothing to read."""
                try:
                    readable, _, _ = select.select([self.connection], [], [], 0)
                    return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    return True

            def _answer(self, code: int, data: bytes | str) -> bool:
                """Send the answer; False when the client is gone (no one to answer)."""
                payload = data.encode() if isinstance(data, str) else data
                if self._client_gone():
                    self.close_connection = True
                    return False
                try:
                    self.send_response(code)
                    self.send_header("Content-Length", str(len(payload)))
                    if isinstance(data, str):
                        self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:  # it went away while we wrote
                    self.close_connection = True
                    return False
                return True

            do_GET = do_POST = _forward  # noqa: N815 (http.server's names)

            def log_message(self, *args: Any) -> None:
                pass

        return Proxy
