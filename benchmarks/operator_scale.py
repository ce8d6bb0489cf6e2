"""Operator scale benchmark against the control-plane test tier (real CRD server + shim on etcd).

Creates N RLJobs (default 200; 3 policies each, so coordinator + workflow + 3 x (rollout, trainer)
pods, 8 Services, a ConfigMap, a Secret, a ServiceAccount and 2 NetworkPolicies: 21 children per job) and reports, as ratios against the
machine's own bound measured in the same run:

* p50/p99 seconds from an RLJob's create to all of its children existing;
* child-creation rate of the operator / rate of a raw client creating the same objects with the
  same number of requests in flight (the API server's own write bound here);
* API requests per reconcile of an unchanged job (reads and writes; the target is 0 writes);
* the operator process's peak RSS (VmHWM).

Usage: .venv/bin/python benchmarks/operator_scale.py [--jobs 200] [--concurrency 16] [--json FILE]
The operator runs as a real process (``polyrl operator``), exactly as deployed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))

from polyrl_operator.kube import CHILD_API_VERSIONS, PLURALS, Credentials, KubeClient, path_for  # noqa: E402
from polyrl_operator.planning import render  # noqa: E402
from polyrl_operator.settings import OperatorSettings  # noqa: E402
from polyrl_testenv import ControlPlane  # noqa: E402

KINDS = {
    kind: PLURALS[kind]
    for kind in OperatorSettings.model_validate({"kueue": {"enabled": False}}).child_kinds()
}


def job_doc(name: str, namespace: str) -> dict[str, Any]:
    policy = {
        "model": {"uri": "builtin://tiny"},
        "rollout": {"engine": "torch", "gpus": 0, "replicas": {"min": 1, "max": 2}},
        "trainer": {"gpus": 0, "replicas": 1},
    }
    return {
        "apiVersion": "polyrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "image": "polyrl-runtime:bench",
            "training": {"totalSteps": 10},
            "workflow": {"entrypoint": "polyrl_runtime.workflows.signal:SignalGame"},
            "policies": [{"name": p, **policy} for p in ("alice", "bob", "carol")],
        },
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def bounded(n: int, coros: list[Any]) -> list[Any]:
    sem = asyncio.Semaphore(n)

    async def run(c: Any) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(run(c) for c in coros))


async def raw_rate(client: KubeClient, namespace: str, jobs: int, concurrency: int) -> tuple[float, int]:
    """Create every child the operator would create for ``jobs`` jobs, with a raw client."""
    settings = OperatorSettings()
    manifests = []
    for i in range(jobs):
        manifests += render(job_doc(f"raw-{i:04d}", namespace), settings, namespace=namespace)
    for m in manifests:
        m.pop("stringData", None)
    start = time.perf_counter()
    await bounded(
        concurrency,
        [client.create(path_for(CHILD_API_VERSIONS[m["kind"]], m["kind"], namespace), m) for m in manifests],
    )
    elapsed = time.perf_counter() - start
    return len(manifests) / elapsed, len(manifests)


async def watch_children(server: str, namespace: str, seen: dict[str, float], stop: asyncio.Event) -> None:
    """Record the first time each child (by job) is seen, through watch streams."""

    async def one(kind: str) -> None:
        plural = KINDS[kind]
        collection = path_for(CHILD_API_VERSIONS[kind], kind, namespace)
        url = f"{server}{collection}?watch=true&labelSelector=polyrl.dev%2Fjob"
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session,
            session.get(url) as resp,
        ):
            async for line in resp.content:
                event = json.loads(line)
                name = f"{plural}/{event['object']['metadata']['name']}"
                if event["type"] == "ADDED" and name not in seen:
                    seen[name] = time.perf_counter()
                if stop.is_set():
                    return

    tasks = [asyncio.create_task(one(k)) for k in KINDS]
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def scrape(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(
            r"^(polyrl_api_requests_total|polyrl_reconciles_total)\{(\w+)=\"(\w+)\"\} ([0-9.e+]+)$", line
        )
        if m:
            out[f"{m[1]}:{m[3]}"] = float(m[4])
    return out


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    plane = ControlPlane.start()
    results: dict[str, Any] = {"jobs": args.jobs, "concurrency": args.concurrency}
    proc: subprocess.Popen[bytes] | None = None
    try:
        crd = plane.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "polyrl.dev_rljobs.yaml"))
        assert crd.returncode == 0, crd.stderr
        plane.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s", "crd/rljobs.polyrl.dev", check=True
        )
        for ns in ("raw", "bench"):
            plane.create_namespace(ns)
        client = KubeClient(Credentials(server=plane.server))

        rate_raw, objects = await raw_rate(client, "raw", args.jobs, args.concurrency)
        results["raw_objects"] = objects
        results["raw_rate_per_s"] = round(rate_raw, 1)
        print(f"raw client: {objects} objects at {rate_raw:.1f}/s", flush=True)

        settings = {
            "resyncSeconds": args.resync,
            "maxConcurrentReconciles": args.concurrency,
            "maxConcurrentWrites": 8,
        }
        workdir = plane.workdir
        (workdir / "bench-settings.yaml").write_text(yaml.safe_dump(settings))
        metrics_port = free_port()
        log = (workdir / "bench-operator.log").open("wb")
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "polyrl_operator.cli", "operator", "--namespace", "bench",
                "--kubeconfig", str(plane.kubeconfig), "--settings", str(workdir / "bench-settings.yaml"),
                "--metrics-port", str(metrics_port), "--liveness", "",
            ],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        for _ in range(200):  # wait for the metrics endpoint (the operator is up)
            try:
                scrape(metrics_port)
                break
            except OSError:
                await asyncio.sleep(0.1)
        seen: dict[str, float] = {}
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_children(plane.server, "bench", seen, stop))
        await asyncio.sleep(1.0)  # watches established
        expected = {
            f"job-{i:04d}": {
                f"{KINDS[m['kind']]}/{m['metadata']['name']}"
                for m in render(job_doc(f"job-{i:04d}", "bench"), OperatorSettings(), namespace="bench")
            }
            for i in range(args.jobs)
        }
        created_at: dict[str, float] = {}

        async def create(name: str) -> None:
            await client.create(path_for("polyrl.dev/v1alpha1", "RLJob", "bench"), job_doc(name, "bench"))
            created_at[name] = time.perf_counter()

        start = time.perf_counter()
        await bounded(args.concurrency, [create(name) for name in expected])
        deadline = time.perf_counter() + args.timeout
        while not all(children <= seen.keys() for children in expected.values()):
            if time.perf_counter() > deadline:
                raise SystemExit(
                    "timed out waiting for the operator; see " + str(workdir / "bench-operator.log")
                )
            await asyncio.sleep(0.2)
        latencies = sorted(
            max(seen[c] for c in children) - created_at[job] for job, children in expected.items()
        )
        last = max(max(seen[c] for c in children) for children in expected.values())
        total = sum(len(c) for c in expected.values())
        rate_op = total / (last - start)
        stop.set()
        await watcher
        results["operator_objects"] = total
        results["operator_rate_per_s"] = round(rate_op, 1)
        results["rate_ratio_operator_over_raw"] = round(rate_op / rate_raw, 3)
        results["create_to_children_p50_s"] = round(statistics.median(latencies), 3)
        results["create_to_children_p99_s"] = round(
            latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3
        )
        print(
            f"operator: {total} children at {rate_op:.1f}/s (ratio {rate_op / rate_raw:.2f} of raw)",
            flush=True,
        )

        # Let status settle (the Pending->... writes after creation), then measure unchanged resyncs.
        await asyncio.sleep(max(3 * args.resync, 3))
        before = scrape(metrics_port)
        await asyncio.sleep(args.quiet_rounds * args.resync + 0.5)
        after = scrape(metrics_port)

        def delta(key: str) -> float:
            return after.get(key, 0.0) - before.get(key, 0.0)

        reconciles = sum(delta(k) for k in after if k.startswith("polyrl_reconciles_total"))
        writes = sum(delta(f"polyrl_api_requests_total:{v}") for v in ("create", "patch", "delete"))
        reads = sum(delta(f"polyrl_api_requests_total:{v}") for v in ("get", "list"))
        results["unchanged_reconciles"] = int(reconciles)
        results["writes_per_unchanged_reconcile"] = round(writes / reconciles, 4) if reconciles else None
        results["requests_per_unchanged_reconcile"] = (
            round((writes + reads) / reconciles, 4) if reconciles else None
        )
        results["operator_peak_rss_mib"] = round(peak_rss_mib(proc.pid), 1)
        await client.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        plane.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument(
        "--concurrency", type=int, default=16, help="requests in flight (raw) / reconciles in parallel"
    )
    parser.add_argument(
        "--resync", type=float, default=2.0, help="operator resync period for the unchanged-job phase"
    )
    parser.add_argument("--quiet-rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
