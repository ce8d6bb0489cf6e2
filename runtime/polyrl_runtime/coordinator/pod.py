"""Pod entry points (docs/runtime-contract.md): what the operator's pods run.

    polyrl-runtime coordinator --config FILE     Ray head + driver + /progress on POLYRL_HTTP_PORT
    polyrl-runtime worker --config FILE --role ROLE [--policy NAME]
                                                 joins the head with one unit of `polyrl/<policy>/<role>`
                                                 and waits; relays its drain annotation to the coordinator

The Ray processes are children of a `ray start --block` process that we own: stopping it (SIGTERM)
stops exactly this node's Ray, never other Ray sessions on the machine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import structlog
from aiohttp import web

from polyrl_operator.api import RLJob
from polyrl_runtime import netmap
from polyrl_runtime.config import (
    JobFileError,
    PodEnv,
    load_job,
    read_annotations,
    resource_name,
    set_env_defaults,
)

log = structlog.get_logger(__name__)

DRAIN_ANNOTATION = "polyrl.dev/drain"
CHECKPOINT_ANNOTATION = "polyrl.dev/checkpoint-request"
RAY_GCS_PORT = 6379
RAY_CLIENT_PORT = 10001


def _temp_dir(ray_port: int | None = None) -> str:
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


def _node_ports() -> list[str]:
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


def _reachable(address: str, timeout: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def stop_ray(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _load(config: str) -> tuple[PodEnv, RLJob] | None:
    """The pod's environment and job file (None after printing why the file is unusable)."""
    set_env_defaults()
    try:
        return PodEnv.from_env(), load_job(config)
    except JobFileError as e:
        sys.stderr.write(f"error: {e}\n")
        return None


def _scratch(job_name: str) -> Path:
    """The pod's scratch (TMPDIR, the /tmp emptyDir): per pod, so never another job's files."""
    return Path(tempfile.gettempdir()) / "polyrl" / job_name


# -- coordinator ---------------------------------------------------------------------------------


def run_coordinator(
    config: str, *, out: str | None = None, ray_port: int | None = None, http_port: int | None = None
) -> int:
    loaded = _load(config)
    if loaded is None:
        return 2
    env, job = loaded
    out_dir = Path(out) if out else _scratch(job.metadata.name)
    ray_port = netmap.listen_port(RAY_GCS_PORT) if ray_port is None else ray_port
    head = start_ray(
        # A private temp dir: `ray start` records its address there, not in /tmp/ray, so other Ray
        # users on the machine (plain `ray.init()`) never find and join this cluster by accident.
        [
            "--head",
            f"--port={ray_port}",
            f"--temp-dir={_temp_dir(ray_port)}",
            "--include-dashboard=false",
            f"--ray-client-server-port={netmap.listen_port(RAY_CLIENT_PORT)}",
            "--num-cpus=0",
            '--resources={"polyrl/coordinator": 1}',
            *_node_ports()[1:],
        ],
        out_dir / "ray-head.log",
    )
    try:
        return asyncio.run(
            _coordinate(job, env, out_dir, ray_port, env.http_port if http_port is None else http_port)
        )
    finally:
        stop_ray(head)


async def _connect(address: str, temp_dir: str, deadline_s: float = 120.0) -> None:
    import ray

    start = time.monotonic()
    while True:
        try:
            ray.init(address=address, _temp_dir=temp_dir, logging_level=logging.ERROR, log_to_driver=False)
            return
        except (ConnectionError, RuntimeError) as e:
            if time.monotonic() - start > deadline_s:
                raise RuntimeError(f"Ray head at {address} did not come up: {e}") from e
            await asyncio.sleep(1.0)


async def _coordinate(job: RLJob, env: PodEnv, out_dir: Path, ray_port: int, http_port: int) -> int:
    import ray

    from polyrl_runtime.coordinator.checkpoint import checkpoint_root
    from polyrl_runtime.coordinator.driver import Driver, DriverOptions
    from polyrl_runtime.coordinator.progress_server import ProgressServer

    opts = DriverOptions(
        out_dir=out_dir,
        checkpoint_root=checkpoint_root(job.spec.checkpoint.uri, out_dir),
        resume=True,
        same_host=False,
        checkpoint_requests=lambda: read_annotations(env.podinfo_dir).get(CHECKPOINT_ANNOTATION),
        attempt=env.attempt,
    )
    driver = Driver(job, opts)
    server = ProgressServer(driver, "0.0.0.0", http_port)
    await server.start()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, driver.stop, "terminated")
    loop.add_signal_handler(signal.SIGINT, driver.stop, "interrupted")
    try:
        await _connect(f"127.0.0.1:{ray_port}", _temp_dir(ray_port))
        summary = await driver.run()
    finally:
        # The operator reads the final /progress (final versions and rewards; done, or failed and not
        # retryable) before this pod ends: keep serving until it did, at most POLYRL_LINGER_S seconds.
        # A SIGTERM (the pod is being deleted) ends the wait.
        served, deadline = server.served, time.monotonic() + float(os.environ.get("POLYRL_LINGER_S", "30"))
        while server.served == served and not driver.interrupted and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        await server.stop()
        ray.shutdown()
    log.info("coordinator.finished", state=summary.state, message=summary.message, steps=summary.steps)
    # The last line of the log: the run's counters, for people and tests (every sample accounted for).
    counters = {
        "state": summary.state,
        "message": summary.message,
        "steps": summary.steps,
        "episodes": summary.episodes,
        "failed": summary.failed,
        "dropped": summary.dropped,
        "buffers": summary.buffers,
    }
    sys.stdout.write(json.dumps(counters) + "\n")
    return 0 if summary.state == "done" else (3 if driver.interrupted else 1)


# -- worker --------------------------------------------------------------------------------------


def run_worker(
    config: str, *, role: str, policy: str | None, address: str | None = None, http_port: int | None = None
) -> int:
    loaded = _load(config)
    if loaded is None:
        return 2
    env, job = loaded
    names = [p.name for p in job.spec.policies]
    if role in ("rollout", "trainer") and policy not in names:
        sys.stderr.write(f"error: --policy must name one of the job's policies {names} for role {role}\n")
        return 2
    addr = address or netmap.resolve(env.coordinator_address)
    if not addr:
        sys.stderr.write("error: no coordinator address (--address or POLYRL_COORDINATOR_ADDRESS)\n")
        return 2
    return asyncio.run(
        _work(
            job.metadata.name,
            env,
            role=role,
            policy=policy if role != "workflow" else None,
            address=addr,
            http_port=env.http_port if http_port is None else http_port,
            units=_units(job, role, policy),
        )
    )


def _units(job: RLJob, role: str, policy: str | None) -> int:
    """Units of the role's placement resource this pod offers: one per trainer rank (one per GPU,
    or `trainer.ranksPerPod`), one for any other role."""
    if role != "trainer":
        return 1
    return next(p.trainer.ranks for p in job.spec.policies if p.name == policy)


async def _work(
    job_name: str, env: PodEnv, *, role: str, policy: str | None, address: str, http_port: int, units: int
) -> int:
    resources = json.dumps({resource_name(policy, role): units})
    join_deadline = float(os.environ.get("POLYRL_JOIN_TIMEOUT_S", "600"))
    start_timeout = float(os.environ.get("POLYRL_RAY_START_TIMEOUT_S", "90"))
    log_path = _scratch(job_name) / f"ray-{role}-{policy or 'job'}-{env.index}-{os.getpid()}.log"
    ready = asyncio.Event()
    runner = await _serve_health(ready, http_port)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    loop.add_signal_handler(signal.SIGINT, stopping.set)
    relay = asyncio.create_task(_relay_drain(env))
    last_join = time.monotonic()
    code = 1
    try:
        while not stopping.is_set():
            if not await asyncio.to_thread(_reachable, address):
                # The head is not up (yet, or any more): wait for it, up to the join deadline.
                if time.monotonic() - last_join > join_deadline:
                    log.error("worker.head_gone", address=address)
                    break
                await asyncio.sleep(2.0)
                continue
            offset = log_path.stat().st_size if log_path.exists() else 0
            proc = start_ray(
                [
                    f"--address={address}",
                    f"--temp-dir={_temp_dir()}",
                    f"--resources={resources}",
                    *_node_ports(),
                ],
                log_path,
            )
            started = time.monotonic()
            unreachable = 0
            while proc.poll() is None and not stopping.is_set():
                # The raylet outlives a dead head for a while; notice it ourselves and rejoin.
                unreachable = 0 if await asyncio.to_thread(_reachable, address) else unreachable + 1
                if unreachable >= 10:
                    log.warning("worker.head_unreachable", address=address)
                    break
                if not ready.is_set():
                    if _ray_started(log_path, offset):  # ready = this node really joined
                        ready.set()
                        log.info("worker.joined", role=role, policy=policy, address=address)
                    elif time.monotonic() - started > start_timeout:
                        # A `ray start` can wait forever on a GCS that is slow to answer (an
                        # overloaded head): start over rather than stay a pod that never joins.
                        log.warning("worker.start_timeout", address=address, after_s=start_timeout)
                        break
                await asyncio.sleep(1.0)
            last_join = time.monotonic()  # the rejoin window starts when we lose the head
            ready.clear()
            stop_ray(proc)
            if stopping.is_set():
                code = 0
                break
    finally:
        relay.cancel()
        await runner.cleanup()
    return code


def _ray_started(log_path: Path, offset: int) -> bool:
    """Whether the `ray start` writing to ``log_path`` from ``offset`` on reported its node up."""
    try:
        with log_path.open("rb") as f:
            f.seek(offset)
            return b"Ray runtime started" in f.read()
    except OSError:
        return False


async def _serve_health(ready: asyncio.Event, port: int) -> web.AppRunner:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok") if ready.is_set() else web.Response(status=503, text="joining")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


async def _relay_drain(env: PodEnv, period_s: float = 2.0) -> None:
    """Forward this pod's `polyrl.dev/drain` annotation to the coordinator's POST /drain."""
    host = env.coordinator_address.rsplit(":", 1)[0]
    port = os.environ.get("POLYRL_COORDINATOR_HTTP_PORT", "8000")
    sent = False
    while True:
        url = f"http://{netmap.resolve(f'{host}:{port}')}/drain"
        draining = read_annotations(env.podinfo_dir).get(DRAIN_ANNOTATION, "").lower() == "true"
        if draining != sent and env.pod_name:  # only changes are sent
            body = json.dumps({"target": env.pod_name, "draining": draining}).encode()
            req = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method="POST")
            try:
                await asyncio.to_thread(urllib.request.urlopen, req, timeout=5)
                sent = draining
            except OSError as e:
                log.debug("drain.relay_failed", url=url, error=str(e))
        await asyncio.sleep(period_s)
