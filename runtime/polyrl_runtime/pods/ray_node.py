"""This pod's Ray node: `ray start --block` as a child process, its arguments and its log.

The Ray processes are children of a `ray start --block` process that we own: stopping it (SIGTERM)
stops exactly this node's Ray, never other Ray clusters on the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import structlog

from polyrl_runtime import netmap

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


def _ray_bin() -> str:
    local = Path(sys.executable).parent / "ray"
    return str(local) if local.exists() else (shutil.which("ray") or "ray")


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
    cmd = [_ray_bin(), "start", "--block", "--disable-usage-stats", *args]
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
