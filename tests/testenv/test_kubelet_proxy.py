"""The test kubelet's Service proxy (`make laptop`, the e2e tier): a pod that answers slowly is one
log line naming the pod, the request and how long it took, never a traceback."""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from polyrl_testenv.kubeproxy import ServiceProxy


class Pod:
    """A pod's HTTP server whose answers wait until the test releases them."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.asked = threading.Event()
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                pod.asked.set()
                pod.release.wait(30)
                data = b'{"state": "running"}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.address = f"127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pod() -> Iterator[Pod]:
    p = Pod()
    yield p
    p.stop()


def _proxy(pod: Pod, timeout_s: float = 30.0) -> ServiceProxy:
    def resolve(ns: str, svc: str, port: str) -> tuple[str, str] | None:
        known = (svc, port) == ("job-coordinator", "8000")
        return (pod.address, f"{ns}/job-coordinator-0") if known else None

    return ServiceProxy(resolve, timeout_s=timeout_s).start()


def _url(proxy: ServiceProxy, path: str = "team-a/job-coordinator/8000/progress") -> str:
    return f"http://127.0.0.1:{proxy.port}/{path}"


def test_forwards_to_the_pod_of_the_service(pod: Pod) -> None:
    proxy = _proxy(pod)
    try:
        pod.release.set()
        with urllib.request.urlopen(_url(proxy), timeout=30) as r:
            assert r.status == 200 and r.read() == b'{"state": "running"}'
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(_url(proxy, "team-a/other/8000/progress"), timeout=30)
        assert e.value.code == 502
        assert proxy.slow == []
    finally:
        proxy.stop()


def test_a_pod_that_answers_after_its_client_gave_up_is_one_line(
    pod: Pod, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    proxy = _proxy(pod)
    try:
        with caplog.at_level(logging.WARNING, logger="polyrl_testenv.kubelet"):
            client = socket.create_connection(("127.0.0.1", proxy.port))
            client.sendall(b"GET /team-a/job-coordinator/8000/progress HTTP/1.1\r\nHost: x\r\n\r\n")
            assert pod.asked.wait(30)
            client.close()  # the operator's timeout: it gives up before the pod answers
            pod.release.set()
            for _ in range(300):  # the proxy's handler ends after the pod's late answer
                if proxy.slow:
                    break
                time.sleep(0.1)
        assert len(proxy.slow) == 1, proxy.slow
        line = proxy.slow[0]
        assert "pod team-a/job-coordinator-0" in line and "GET /progress" in line
        assert "answered" in line and " s, when its client had already given up" in line
        assert [r.getMessage() for r in caplog.records] == [line]
    finally:
        proxy.stop()
    assert "Traceback" not in capfd.readouterr().err


def test_a_pod_that_does_not_answer_in_time_is_a_504_and_one_line(
    pod: Pod, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    proxy = _proxy(pod, timeout_s=0.2)  # the pod answers only when released: it never does in time
    try:
        with (
            caplog.at_level(logging.WARNING, logger="polyrl_testenv.kubelet"),
            pytest.raises(urllib.error.HTTPError) as e,
        ):
            urllib.request.urlopen(_url(proxy), timeout=30)
        assert e.value.code == 504
        assert len(proxy.slow) == 1
        line = proxy.slow[0]
        assert line.startswith("slow pod: pod team-a/job-coordinator-0 (service job-coordinator port 8000)")
        assert "did not answer GET /progress within" in line
        assert [r.getMessage() for r in caplog.records] == [line]
    finally:
        proxy.stop()
    assert "Traceback" not in capfd.readouterr().err
