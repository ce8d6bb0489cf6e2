"""This pod's Ray node: `ray start --block` as a child process, its arguments and its log.

The Ray processes are children of a `ray start --block` process that we own: stopping it (SIGTERM)
stops exactly this node's Ray, never other Ray clusters on the machine.

The coordinator's head is a `RayHead`: started again when it exits, or when its GCS does not accept
connections within `HEAD_START_S`, up to `HEAD_STARTS` starts. Ray's GCS can abort as it starts (Ray
2.60: "pure virtual method called" in gcs_server.err); its `ray start --block` then notices only 60 s
later, and a driver that calls `ray.init` against the dead GCS retries inside Ray, past any
deadline of ours. So the coordinator calls `ray.init` only once the GCS accepts connections.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import structlog

from polyrl_runtime import netmap
from polyrl_runtime.waiting import Wait, WaitTimeout

log = structlog.get_logger(__name__)


def ray_temp_dir(ray_port: int | None = None) -> str:
    """This node's own Ray temp dir (sockets, logs), in the pod's /tmp; the head's is also named by
    its port, which is where `ray start` records the cluster address.

    A joining node without one takes the head's, and nodes that share a host (the test kubelet)
    then race for the same socket names: two raylets starting together pick the same
    `plasma_store.N`, one dies on "bind: Address already in use" and its `ray start` times out 30 s
    later. Short on purpose: Ray puts the Unix sockets ~60 characters below it and a socket path
    must stay under 108."""
    return f"{tempfile.gettempdir()}/ray" + (f"-{ray_port}" if ray_port else "")


def node_ports() -> list[str]:
    """Explicit free ports for one node's Ray agents, so several nodes can share a host (tests)."""
    names = (
        "node-manager-port",
        "object-manager-port",
        "metrics-export-port",
        "runtime-env-agent-port",
        "dashboard-agent-grpc-port",
        "dashboard-agent-listen-port",
    )
    return [f"--{n}={netmap.free_port()}" for n in names]


def start_ray(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # No log monitor: it pushes the node's actor logs to drivers that ask for them, and the job's
    # only driver (the coordinator) connects with log_to_driver=False; it would poll the node's log
    # files ten times a second for nobody (about 1% of a core on an idle node, more as workers add
    # log files). The logs stay in the node's session directory.
    # Ray's own `ray start`, through ray_cli.py: the CLI without the command groups a pod never runs.
    ray_start = [sys.executable, "-m", "polyrl_runtime.pods.ray_cli", "start"]
    cmd = [*ray_start, "--block", "--disable-usage-stats", "--include-log-monitor=false", *args]
    log.info("ray.start", cmd=" ".join(cmd))
    # unbuffered: the worker reads "Ray runtime started" from this log to know it joined
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def stop_ray(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def head_args(ray_port: int, client_port: int, *, dashboard_port: int | None) -> list[str]:
    """`ray start` arguments of the coordinator's head; `dashboard_port` None: no dashboard."""
    # A private temp dir: `ray start` records its address there, not in /tmp/ray, so other Ray
    # users on the machine (plain `ray.init()`) never find and join this cluster by accident.
    dashboard = (
        ["--include-dashboard=true", "--dashboard-host=0.0.0.0", f"--dashboard-port={dashboard_port}"]
        if dashboard_port is not None
        else ["--include-dashboard=false"]
    )
    return [
        "--head",
        f"--port={ray_port}",
        f"--temp-dir={ray_temp_dir(ray_port)}",
        *dashboard,
        f"--ray-client-server-port={client_port}",
        "--num-cpus=0",
        '--resources={"polyrl/coordinator": 1}',
        *node_ports()[1:],
    ]


def ray_started(log_path: Path, offset: int) -> bool:
    """Whether the `ray start` writing to ``log_path`` from ``offset`` on reported its node up."""
    try:
        with log_path.open("rb") as f:
            f.seek(offset)
            return b"Ray runtime started" in f.read()
    except OSError:
        return False


HEAD_STARTS = 3
HEAD_START_S = 30.0


def accepts_connections(port: int, timeout: float = 1.0) -> bool:
    """Whether something on this host accepts TCP connections on `port` now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


class RayHead:
    """The coordinator's Ray head: `launch()` starts one `ray start --head --block` (logging to
    `log_path`, its GCS on `port`); `up()` waits for its GCS and starts it again when it failed."""

    def __init__(
        self,
        launch: Callable[[], subprocess.Popen[bytes]],
        port: int,
        log_path: Path,
        *,
        starts: int = HEAD_STARTS,
        start_s: float = HEAD_START_S,
    ) -> None:
        self.launch, self.port, self.log_path = launch, port, log_path
        self.max_starts, self.start_s = starts, start_s
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = self.launch()
        self.starts += 1

    def stop(self) -> None:
        if self.proc is not None:
            stop_ray(self.proc)

    async def up(self, poll_s: float = 0.5) -> None:
        """Until the head's GCS accepts connections (starting the head first if it is not started).
        A head that exits, or whose GCS stays closed for `start_s`, is stopped and started again;
        WaitTimeout, naming the head's log, once `starts` starts have failed."""
        if self.proc is None:
            self.start()
        while True:
            assert self.proc is not None
            wait = Wait(
                f"this pod's Ray head (GCS port {self.port}, start {self.starts} of {self.max_starts})",
                self.start_s,
                fields={"ray_log": str(self.log_path)},
            )
            while self.proc.poll() is None and not wait.expired():
                if await asyncio.to_thread(accepts_connections, self.port):
                    wait.done()
                    return
                wait.tick("its GCS does not accept connections yet")
                await asyncio.sleep(poll_s)
            code = self.proc.poll()
            why = (
                f"exited with code {code}"
                if code is not None
                else f"its GCS accepted no connection within {self.start_s:g} s"
            )
            if self.starts >= self.max_starts:
                raise WaitTimeout(
                    f"the Ray head failed {self.starts} starts, the last one {why}; see {self.log_path}"
                )
            log.warning("ray.head_restart", reason=why, start=self.starts + 1, ray_log=str(self.log_path))
            self.stop()
            self.start()
