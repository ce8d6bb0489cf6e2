"""Pod entry points (docs/runtime-contract.md): what the operator's pods run.

    polyrl-runtime coordinator --config FILE     Ray head + driver + /progress on POLYRL_HTTP_PORT
    polyrl-runtime worker --config FILE --role ROLE [--policy NAME]
                                                 joins the head with one unit of `polyrl/<policy>/<role>`
                                                 (one per rank on a trainer pod) and waits; relays its
                                                 drain annotation to the coordinator
    polyrl-runtime worker --config FILE --role pool --pool NAME
                                                 the same for a device pool's pod: it offers the units of
                                                 every role placed on the pool (config.node_resources)

Each pod's Ray node is a child process it owns (ray_node.py).

No wait is silent or endless (`polyrl_runtime.waiting`): a worker waits for the head at most
`POLYRL_JOIN_TIMEOUT_S` (600 s) and resolves the head's address again on every try (the Service's
endpoint may not exist yet, or may move), then exits 1 naming the address and the time waited; the
coordinator waits for its own head (120 s) and for the job's actors to start, i.e. the worker pods
to join and the models to load (`POLYRL_START_TIMEOUT_S`, 1800 s), saying which placement
resources are still missing.

With `spec.coordinator.dashboard` the head serves the Ray dashboard on 0.0.0.0:8265; without it the
head starts none, and the operator exposes no dashboard port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
import time
import urllib.request
from functools import partial
from pathlib import Path

import structlog
from aiohttp import web

from polyrl_operator import pod_contract as contract
from polyrl_operator.api import RLJob
from polyrl_runtime import netmap
from polyrl_runtime.config import (
    JobFileError,
    PodEnv,
    load_job,
    node_resources,
    read_annotations,
    set_env_defaults,
)
from polyrl_runtime.pods.cluster_waits import head_attempt, split_address, wait_for_head, watch_start
from polyrl_runtime.pods.ray_node import (
    RayHead,
    head_args,
    node_ports,
    ray_started,
    ray_temp_dir,
    start_ray,
    stop_ray,
)
from polyrl_runtime.waiting import Attempt, Wait, WaitTimeout, wait_until
from polyrl_runtime.workflows.preflight import entry_point_problems

log = structlog.get_logger(__name__)


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
    http = env.http_port if http_port is None else http_port
    problems = entry_point_problems(job.spec)
    if problems:
        # No Ray head for a job whose code does not import: the driver finds the same problems as
        # its first step and serves them on /progress as a failure restarting cannot fix.
        log.error("job.preflight_failed", problems=[str(p) for p in problems])
        return asyncio.run(_coordinate(job, env, out_dir, None, http))
    ray_port = netmap.listen_port(contract.PORT_RAY_GCS) if ray_port is None else ray_port
    dashboard = netmap.listen_port(contract.PORT_RAY_DASHBOARD) if job.spec.coordinator.dashboard else None
    args = head_args(ray_port, netmap.listen_port(contract.PORT_RAY_CLIENT), dashboard_port=dashboard)
    head = RayHead(partial(start_ray, args, out_dir / "ray-head.log"), ray_port, out_dir / "ray-head.log")
    head.start()  # it boots while this process imports the driver
    try:
        return asyncio.run(_coordinate(job, env, out_dir, head, http))
    except WaitTimeout as e:
        log.error("coordinator.head_failed", error=str(e), ray_log=str(head.log_path))
        sys.stderr.write(f"error: {e}\n")
        return 1
    finally:
        head.stop()


async def _connect(address: str, temp_dir: str, deadline_s: float = 120.0) -> None:
    import ray

    async def attempt() -> Attempt[bool]:
        try:
            ray.init(address=address, _temp_dir=temp_dir, logging_level=logging.ERROR, log_to_driver=False)
            return Attempt(True)
        except (ConnectionError, RuntimeError) as e:
            return Attempt(None, str(e))

    await wait_until(
        attempt, what=f"this pod's Ray head at {address}", deadline_s=deadline_s, address=address
    )


async def _coordinate(job: RLJob, env: PodEnv, out_dir: Path, head: RayHead | None, http_port: int) -> int:
    """Run the driver and serve /progress; `head` None: no Ray head was started (the job's code
    does not import), and the driver reports that failure without connecting to one."""
    import ray

    from polyrl_runtime.coordinator.checkpoints.store import checkpoint_root
    from polyrl_runtime.coordinator.driver import Driver, DriverOptions
    from polyrl_runtime.coordinator.progress_server import ProgressServer

    opts = DriverOptions(
        out_dir=out_dir,
        checkpoint_root=checkpoint_root(job.spec.checkpoint.uri, out_dir),
        resume=True,
        same_host=False,
        checkpoint_requests=lambda: read_annotations(env.podinfo_dir).get(
            contract.ANNOTATION_CHECKPOINT_REQUEST
        ),
        attempt=env.attempt,
    )
    driver = Driver(job, opts)
    server = ProgressServer(driver, "0.0.0.0", http_port)
    await server.start()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, driver.stop, "terminated")
    loop.add_signal_handler(signal.SIGINT, driver.stop, "interrupted")
    start_deadline = float(os.environ.get("POLYRL_START_TIMEOUT_S", "1800"))
    try:
        if head is None:
            summary = await driver.run()  # fails at its first step, which makes no Ray call
        else:
            await head.up()
            await _connect(f"127.0.0.1:{head.port}", ray_temp_dir(head.port))
            run = asyncio.create_task(driver.run())
            watch = asyncio.create_task(watch_start(driver, job, start_deadline))
            await asyncio.wait({run, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done() and not watch.cancelled() and isinstance(watch.exception(), WaitTimeout):
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                log.error("coordinator.start_timeout", error=str(watch.exception()))
                return 1
            watch.cancel()
            summary = await run
    finally:
        # The operator reads the final /progress (final versions and rewards; done, or failed and not
        # retryable) before this pod ends: keep serving until it did, at most POLYRL_LINGER_S seconds.
        # A SIGTERM (the pod is being deleted) ends the wait.
        linger = float(os.environ.get("POLYRL_LINGER_S", "30"))
        served, deadline = server.served, time.monotonic() + linger
        if linger > 0 and not driver.interrupted:
            log.info(
                "coordinator.lingering",
                waiting_for="the operator to read the final /progress",
                up_to_s=linger,
            )
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
        "aborted": summary.aborted,
    }
    sys.stdout.write(json.dumps(counters) + "\n")
    return 0 if summary.state == "done" else (3 if driver.interrupted else 1)


# -- worker --------------------------------------------------------------------------------------


def run_worker(
    config: str,
    *,
    role: str,
    policy: str | None,
    pool: str | None = None,
    address: str | None = None,
    http_port: int | None = None,
) -> int:
    loaded = _load(config)
    if loaded is None:
        return 2
    env, job = loaded
    pool_source = "--pool" if pool else contract.ENV_POOL
    pool = pool or env.pool or None
    problem = _placement_problem(job, role, policy, pool, pool_source)
    if problem:
        sys.stderr.write(f"error: {problem}\n")
        return 2
    target = address or env.coordinator_address
    if not target:
        sys.stderr.write("error: no coordinator address (--address or POLYRL_COORDINATOR_ADDRESS)\n")
        return 2
    if split_address(target) is None:
        source = "--address" if address else contract.ENV_COORDINATOR_ADDRESS
        sys.stderr.write(f"error: {source}={target!r}: expected HOST:PORT\n")
        return 2
    policy = policy if role in ("rollout", "trainer") else None
    pool = pool if role == "pool" else None
    return asyncio.run(
        _work(
            job.metadata.name,
            env,
            role=role,
            policy=policy,
            pool=pool,
            target=target,
            http_port=env.http_port if http_port is None else http_port,
            resources=node_resources(job, role, policy, pool, env.index),
        )
    )


def _placement_problem(
    job: RLJob, role: str, policy: str | None, pool: str | None, pool_source: str
) -> str | None:
    """Why this pod cannot offer the resources of `role` (and `policy`, or `pool` as `pool_source`
    gave it), or None."""
    spec = job.spec
    if role == "pool":
        pools = ", ".join(sorted(spec.pool_names)) or "it defines none"
        if not pool:
            return f"--role pool needs --pool NAME (or {contract.ENV_POOL}); spec.pools: {pools}"
        if pool not in spec.pool_names:
            return f"{pool_source}={pool}: the job has no pool {pool!r} (spec.pools: {pools})"
        return None
    if role not in ("rollout", "trainer"):
        return None
    found = next((p for p in spec.policies if p.name == policy), None)
    if found is None:
        names = [p.name for p in spec.policies]
        return f"--policy must name one of the job's policies {names} for role {role}"
    if role == "trainer" and found.frozen:
        return f"--role trainer --policy {policy}: policy {policy!r} is frozen (trainer: null): it has no trainer"
    on_pool = found.rollout.pool if role == "rollout" else found.trainer_pool
    if on_pool is not None:
        return (
            f"--role {role} --policy {policy}: policy {policy!r} runs its {role} on pool {on_pool!r}, "
            f"whose pods offer it (--role pool --pool {on_pool})"
        )
    return None


async def _work(
    job_name: str,
    env: PodEnv,
    *,
    role: str,
    policy: str | None,
    pool: str | None,
    target: str,
    http_port: int,
    resources: dict[str, float],
) -> int:
    """Join the head named `target` offering `resources` and stay in its cluster; rejoin when it goes
    away and comes back. Exits 0 on SIGTERM, 1 when the head stays unreachable for
    `POLYRL_JOIN_TIMEOUT_S`."""
    offered = json.dumps(resources)
    join_deadline = float(os.environ.get("POLYRL_JOIN_TIMEOUT_S", "600"))
    start_timeout = float(os.environ.get("POLYRL_RAY_START_TIMEOUT_S", "90"))
    log_path = _scratch(job_name) / f"ray-{role}-{pool or policy or 'job'}-{env.index}-{os.getpid()}.log"
    ready = asyncio.Event()
    runner = await _serve_health(ready, http_port)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    loop.add_signal_handler(signal.SIGINT, stopping.set)
    relay = asyncio.create_task(_relay_drain(env))
    code = 1
    try:
        while not stopping.is_set():
            # The head is not up (yet, or any more): wait for it, up to the join deadline, resolving
            # its name again on every try.
            try:
                address = await wait_for_head(target, deadline_s=join_deadline, stop=stopping)
            except WaitTimeout as e:
                log.error("worker.head_gone", address=target, error=str(e))
                sys.stderr.write(f"error: {e}\n")
                break
            if address is None:  # SIGTERM while waiting
                code = 0
                break
            offset = log_path.stat().st_size if log_path.exists() else 0
            proc = start_ray(
                [
                    f"--address={address}",
                    f"--temp-dir={ray_temp_dir()}",
                    f"--resources={offered}",
                    *node_ports(),
                ],
                log_path,
            )
            joining = Wait(
                f"this node to join the Ray head at {address}",
                start_timeout,
                fields={"address": address, "ray_log": str(log_path)},
            )
            unreachable = 0
            while proc.poll() is None and not stopping.is_set():
                # The raylet outlives a dead head for a while; notice it ourselves and rejoin.
                reachable = (await head_attempt(target)).value is not None
                unreachable = 0 if reachable else unreachable + 1
                if unreachable >= 10:
                    log.warning("worker.head_unreachable", address=address)
                    break
                if not ready.is_set():
                    if ray_started(log_path, offset):  # ready = this node really joined
                        ready.set()
                        joining.done()
                        log.info(
                            "worker.joined",
                            role=role,
                            policy=policy,
                            pool=pool,
                            address=address,
                            resources=resources,
                        )
                    elif joining.expired():
                        # A `ray start` can wait forever on a GCS that is slow to answer (an
                        # overloaded head): start over rather than stay a pod that never joins.
                        log.warning("worker.start_timeout", address=address, after_s=start_timeout)
                        break
                    else:
                        joining.tick("`ray start` has not reported this node up yet")
                await asyncio.sleep(1.0)
            ready.clear()
            stop_ray(proc)
            if stopping.is_set():
                code = 0
                break
    finally:
        relay.cancel()
        await runner.cleanup()
    return code


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
    port = os.environ.get("POLYRL_COORDINATOR_HTTP_PORT", str(contract.PORT_HTTP))
    sent = False
    while True:
        url = f"http://{netmap.resolve(f'{host}:{port}')}/drain"
        draining = read_annotations(env.podinfo_dir).get(contract.ANNOTATION_DRAIN, "").lower() == "true"
        if draining != sent and env.pod_name:  # only changes are sent
            body = json.dumps({"target": env.pod_name, "draining": draining}).encode()
            req = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method="POST")
            try:
                await asyncio.to_thread(urllib.request.urlopen, req, timeout=5)
                sent = draining
            except OSError as e:
                log.debug("drain.relay_failed", url=url, error=str(e))
        await asyncio.sleep(period_s)
