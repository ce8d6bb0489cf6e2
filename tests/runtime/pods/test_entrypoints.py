"""The pods' entry points as separate local processes: `polyrl-runtime coordinator` starts a Ray head
and the driver, `polyrl-runtime worker` processes join it with their role's resources, and the job
trains through them. Also: worker readiness, the checkpoint-request annotation, the drain relay."""

from __future__ import annotations

import asyncio
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
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from polyrl_runtime.config import PodEnv
from polyrl_runtime.pods.entry import _relay_drain

DATA = Path(__file__).parent.parent / "data"
BIN = str(Path(sys.executable).parent / "polyrl-runtime")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = r.read()
            return json.loads(body) if body.startswith(b"{") else r.status
    except OSError:
        return None


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        RAY_AUTH_MODE="disabled",
        POLYRL_LINGER_S="0",
        POLYRL_JOIN_TIMEOUT_S="20",
        POLYRL_PODINFO_DIR=str(tmp / "podinfo-none"),
    )
    env.update(extra)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "polyrl" / "torch_extensions"))
    return env


@pytest.mark.slow
def test_head_and_workers_as_processes_train_a_job(tmp_path: Path) -> None:
    cfg = str(DATA / "selfplay-tiny.yaml")
    gcs, http = _port(), _port()
    podinfo = tmp_path / "coordinator-podinfo"
    podinfo.mkdir()
    # the operator's checkpoint request (suspend/evict), as the downward API shows it to the pod
    (podinfo / "annotations").write_text('polyrl.dev/checkpoint-request="evict-7"\n')
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    short_tmp = tempfile.mkdtemp(prefix="pe")

    def spawn(name: str, args: list[str], **env: str) -> subprocess.Popen[bytes]:
        # each pod has its own /tmp, and Ray's Unix sockets live there: keep it short (< 108 chars)
        scratch = Path(short_tmp) / name
        scratch.mkdir()
        env.setdefault("TMPDIR", str(scratch))
        with (logs / f"{name}.log").open("wb") as out:
            p = subprocess.Popen(
                [BIN, *args], stdout=out, stderr=subprocess.STDOUT, env=_env(tmp_path, **env), cwd=tmp_path
            )
        procs.append(p)
        return p

    try:
        coord = spawn(
            "coordinator",
            [
                "coordinator",
                "--config",
                cfg,
                "--out",
                str(tmp_path / "coord"),
                "--ray-port",
                str(gcs),
                "--http-port",
                str(http),
            ],
            POLYRL_PODINFO_DIR=str(podinfo),
            POLYRL_LINGER_S="4",  # the final /progress stays readable for a moment
            POLYRL_ATTEMPT="2",  # /progress says which restart attempt it reports on
        )
        workers = {}
        for role, policy in (("rollout", "agent"), ("trainer", "agent"), ("workflow", None)):
            hp = _port()
            args = [
                "worker",
                "--config",
                cfg,
                "--role",
                role,
                "--address",
                f"127.0.0.1:{gcs}",
                "--http-port",
                str(hp),
            ]
            args += ["--policy", policy] if policy else []
            workers[role] = (spawn(role, args, POLYRL_POD_NAME=f"selfplay-{role}-0"), hp)
            time.sleep(3)  # raylets on one host start one after another
        # the coordinator answers /progress from the start; it reaches "running" once actors are placed
        deadline = time.monotonic() + 240
        seen: set[str] = set()
        last: dict[str, Any] = {}
        while coord.poll() is None and time.monotonic() < deadline:
            doc = _get(f"http://127.0.0.1:{http}/progress")
            if isinstance(doc, dict):
                seen.add(doc["state"])
                last = doc
            time.sleep(0.3)
        assert coord.wait(timeout=30) == 0, (logs / "coordinator.log").read_text()[-3000:]
        result = json.loads((logs / "coordinator.log").read_text().strip().splitlines()[-1])
        assert (result["state"], result["message"], result["steps"]) == (
            "done",
            "all policies finished",
            {"agent": 3},
        )
        agent = result["buffers"]["agent"]  # every sample produced was trained on, dropped or is left
        assert (
            agent["produced"]
            == agent["consumed"] + sum(result["dropped"]["agent"].values()) + agent["buffered"]
        )
        # a 3-step job may spend all of its running time between two polls on a loaded machine: /progress
        # is checked at the end (it lingers), and the coordinator's log proves the actors were placed
        assert "done" in seen, seen
        assert last["checkpoint"]["lastRequestId"] == "evict-7" and last["policies"][0]["step"] == 3
        assert last["attempt"] == 2
        # the worker pods were ready (their /healthz) while they were part of the cluster: they ran the
        # engine, the trainer and the workflow; the driver placed each actor on its role's node
        for role in workers:
            assert "worker.joined" in (logs / f"{role}.log").read_text(), role
        # each process said first that it started (JSON lines); the coordinator logged what it waited for
        for name in ("coordinator", *workers):
            first = json.loads((logs / f"{name}.log").read_text().splitlines()[0])
            assert first["event"] == "runtime.started", name
        events = [json.loads(line) for line in (logs / "coordinator.log").read_text().splitlines()
                  if line.startswith('{"event"')]  # fmt: skip
        waits = {e["waiting_for"]: e["event"] for e in events if e["event"].startswith("wait.")}
        names = [e["event"] for e in events]
        assert "job.running" in names, names[-5:]
        assert waits["the job's actors to start (worker pods joining, models loading)"] == "wait.done", waits
        ckpts = sorted(p.name for p in (tmp_path / "coord" / "checkpoints").iterdir())
        assert ckpts[-1] == "step-000003"
        final = json.loads((tmp_path / "coord" / "checkpoints" / ckpts[-1] / "state.json").read_text())
        assert final["request_ids"] == ["evict-7"]  # answered once, remembered across restarts
        # with the head gone, workers give up joining after POLYRL_JOIN_TIMEOUT_S and exit
        for role, (p, _) in workers.items():
            assert p.wait(timeout=90) == 1, role
            assert "worker.head_gone" in (logs / f"{role}.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(short_tmp, ignore_errors=True)


def test_drain_annotation_is_relayed_to_the_coordinator(tmp_path: Path) -> None:
    (tmp_path / "annotations").write_text('app="x"\n')
    got: list[dict[str, Any]] = []

    async def scenario() -> None:
        async def drain(request: web.Request) -> web.Response:
            got.append(await request.json())
            return web.json_response({"found": True})

        app = web.Application()
        app.router.add_post("/drain", drain)
        runner = web.AppRunner(app)
        await runner.setup()
        port = _port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        # the coordinator's DNS name reaches it through the test kubelet's address map
        netmap = tmp_path / "netmap.json"
        netmap.write_text(json.dumps({"endpoints": {"job-coordinator.ns.svc:8000": f"127.0.0.1:{port}"}}))
        os.environ["POLYRL_NETMAP"] = str(netmap)
        env = PodEnv.from_env(
            pod_name="job-agent-rollout-1",
            podinfo_dir=str(tmp_path),
            coordinator_address="job-coordinator.ns.svc:6379",
        )
        task = asyncio.create_task(_relay_drain(env, period_s=0.05))
        await asyncio.sleep(0.3)
        assert got == []  # nothing to say while not draining
        (tmp_path / "annotations").write_text('app="x"\npolyrl.dev/drain="true"\n')
        while not got:
            await asyncio.sleep(0.05)
        (tmp_path / "annotations").write_text('app="x"\n')  # drain cancelled
        while len(got) < 2:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        task.cancel()
        await runner.cleanup()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        os.environ.pop("POLYRL_NETMAP", None)
    assert got == [
        {"target": "job-agent-rollout-1", "draining": True},
        {"target": "job-agent-rollout-1", "draining": False},
    ]
