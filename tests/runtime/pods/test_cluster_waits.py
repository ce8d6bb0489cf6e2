"""The pods' processes never wait silently: a worker says what it waits for, resolves the head's
address again on every try and gives up with a clear error; the head serves the Ray dashboard when
the job asks for it. The worker tests run the real `polyrl-runtime worker` process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from polyrl_runtime.pods.cluster_waits import missing_resources, split_address
from polyrl_runtime.pods.ray_node import head_args, start_ray, stop_ray

DATA = Path(__file__).parent.parent / "data"
BIN = str(Path(sys.executable).parent / "polyrl-runtime")
POD_ENV = {
    "POLYRL_JOB": "selfplay",
    "POLYRL_NAMESPACE": "ns",
    "POLYRL_ROLE": "workflow",
    "POLYRL_POD_NAME": "selfplay-workflow-0",
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("job-coordinator.ns.svc:6379", ("job-coordinator.ns.svc", 6379)),
        ("127.0.0.1:1", ("127.0.0.1", 1)),
        ("job-coordinator.ns.svc", None),
        (":6379", None),
        ("host:port", None),
        ("host:70000", None),
    ],
)
def test_addresses_are_host_and_port(address: str, expected: tuple[str, int] | None) -> None:
    assert split_address(address) == expected


@pytest.mark.parametrize(
    ("present", "expected"),
    [
        ({}, {"polyrl/a/rollout": "0/2", "polyrl/a/trainer": "0/1", "polyrl/workflow": "0/1"}),
        ({"polyrl/a/rollout": 1.0, "polyrl/workflow": 1.0, "CPU": 4.0}, {"polyrl/a/rollout": "1/2", "polyrl/a/trainer": "0/1"}),
        ({"polyrl/a/rollout": 2.0, "polyrl/a/trainer": 1.0, "polyrl/workflow": 3.0}, {}),
    ],
)  # fmt: skip
def test_the_coordinator_names_the_worker_nodes_it_still_waits_for(
    present: dict[str, float], expected: dict[str, str]
) -> None:
    needed = {"polyrl/a/rollout": 2.0, "polyrl/a/trainer": 1.0, "polyrl/workflow": 1.0}
    assert missing_resources(needed, present) == expected


class Worker:
    """One `polyrl-runtime worker` process, its stdout (JSON lines) and stderr in files."""

    def __init__(self, tmp: Path, address: str | None = None, **env: str) -> None:
        self.out, self.err = tmp / "worker.out", tmp / "worker.err"
        self.scratch = tempfile.mkdtemp(prefix="pw")  # Ray's socket paths must stay short
        full = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RAY_AUTH_MODE": "disabled",
            "TMPDIR": self.scratch,
            "POLYRL_PODINFO_DIR": str(tmp / "podinfo-none"),
            "POLYRL_PORT_REGISTRY": str(tmp / "ports.json"),
            **POD_ENV,
            **env,
        }
        full.pop("POLYRL_LOG_FORMAT", None)
        args = ["worker", "--config", str(DATA / "selfplay-tiny.yaml"), "--role", "workflow"]
        args += ["--http-port", str(_port())] + (["--address", address] if address else [])
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                [BIN, *args], stdout=out, stderr=err, env=full, cwd=tmp, start_new_session=True
            )

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.strip()]

    def wait_for(self, check: Callable[[list[dict[str, Any]]], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not check(self.lines()):
            assert self.proc.poll() is None, (self.out.read_text(), self.err.read_text())
            assert time.monotonic() < deadline, self.out.read_text()
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the pod's process group (the worker and its `ray start`), as a kubelet does."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout=40)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            shutil.rmtree(self.scratch, ignore_errors=True)


def _events(lines: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [line for line in lines if line["event"] == event]


def test_a_worker_whose_head_never_answers_says_so_and_gives_up(tmp_path: Path) -> None:
    closed = f"127.0.0.1:{_port()}"  # nothing listens there
    worker = Worker(tmp_path, POLYRL_COORDINATOR_ADDRESS=closed, POLYRL_JOIN_TIMEOUT_S="3")
    try:
        assert worker.proc.wait(timeout=60) == 1
    finally:
        worker.stop()
    lines = worker.lines()  # every line of the pod's log is a JSON object
    first = lines[0]
    assert first["event"] == "runtime.started" and first["command"] == "worker"
    assert {k: first[k] for k in ("job", "namespace", "role", "pod")} == {
        "job": "selfplay",
        "namespace": "ns",
        "role": "workflow",
        "pod": "selfplay-workflow-0",
    }
    [wait] = _events(lines, "wait.started")
    assert wait["waiting_for"] == f"the coordinator's Ray head at {closed}" and wait["deadline_s"] == 3
    [gone] = _events(lines, "worker.head_gone")
    assert gone["level"] == "error" and gone["address"] == closed
    error = worker.err.read_text().strip()
    assert error.startswith(f"error: gave up waiting for the coordinator's Ray head at {closed} after "), (
        error
    )
    assert "Connection refused" in error
    assert not _events(lines, "ray.start")


def test_a_worker_resolves_the_head_again_on_every_try(tmp_path: Path) -> None:
    """The head's Service has no endpoint yet when the worker starts (the test kubelet's map lacks
    it): the worker must not keep the unresolved name, but join once the endpoint appears."""
    name = "selfplay-coordinator.ns.svc:6379"
    netmap = tmp_path / "netmap.json"
    netmap.write_text(json.dumps({"pods": {}, "endpoints": {}}))
    worker = Worker(tmp_path, POLYRL_COORDINATOR_ADDRESS=name, POLYRL_NETMAP=str(netmap))
    server = socket.socket()
    try:
        worker.wait_for(lambda lines: bool(_events(lines, "wait.started")))
        time.sleep(2.5)  # a few tries against the name alone
        server.bind(("127.0.0.1", 0))
        server.listen()
        head = f"127.0.0.1:{server.getsockname()[1]}"
        tmp = netmap.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pods": {}, "endpoints": {name: head}}))
        tmp.replace(netmap)
        worker.wait_for(lambda lines: bool(_events(lines, "ray.start")))
    finally:
        # its `ray start` will never join a plain socket: end the whole pod at once
        worker.stop(signal.SIGKILL)
        server.close()
    lines = worker.lines()
    [wait] = _events(lines, "wait.started")[:1]
    assert wait["waiting_for"] == f"the coordinator's Ray head at {name}"
    [done] = _events(lines, "wait.done")[:1]
    assert done["address"] == name and done["waited_s"] >= 2
    [start] = _events(lines, "ray.start")
    assert f"--address={head}" in start["cmd"]


@pytest.mark.ray  # starts a Ray head with its dashboard
def test_the_head_serves_the_ray_dashboard_when_asked_and_runs_no_log_monitor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "--include-dashboard=false" in head_args(1, 2, dashboard_port=None)
    gcs, client, dashboard = _port(), _port(), _port()
    args = head_args(gcs, client, dashboard_port=dashboard)
    assert {"--include-dashboard=true", "--dashboard-host=0.0.0.0", f"--dashboard-port={dashboard}"} <= set(
        args
    )
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    head = start_ray(args, tmp_path / "head.log")
    try:
        deadline, version = time.monotonic() + 90, None
        while version is None and time.monotonic() < deadline and head.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/api/version", timeout=5) as r:
                    version = (r.status, json.loads(r.read()))
            except OSError:
                time.sleep(0.5)
        assert version is not None, (tmp_path / "head.log").read_text()[-3000:]
        status, body = version
        assert status == 200 and body["ray_version"]
        # `ray start` starts the log monitor (when it does) before the raylet
        commands = _commands_below(head.pid)
        while not any("raylet" in c for c in commands) and time.monotonic() < deadline:
            time.sleep(0.5)
            commands = _commands_below(head.pid)
        assert any("raylet" in c for c in commands), commands
        assert not any("log_monitor.py" in c for c in commands), commands
    finally:
        stop_ray(head)


def _commands_below(pid: int) -> list[str]:
    commands = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            commands.append(" ".join(child.cmdline()))
    return commands
