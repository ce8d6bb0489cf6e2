"""The e2e tier: RLJobs applied with kubectl, the real operator process, and the test kubelet that
runs the operator's pods as local processes with the real runtime entry points."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_testenv import ControlPlane
from polyrl_testenv.bad_rljobs import REPO
from polyrl_testenv.kubelet import TestKubelet
from polyrl_testenv.operator_proc import kill, start_operator

KUEUE_DIR = REPO / "tests" / "data" / "kueue"
E2E_DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def cluster(controlplane: ControlPlane) -> ControlPlane:
    """The control plane with the RLJob CRD (ours) and Kueue's CRDs (vendored) installed."""
    for path in [REPO / "crds" / "polyrl.dev_rljobs.yaml", *sorted(KUEUE_DIR.glob("kueue.x-k8s.io_*.yaml"))]:
        done = controlplane.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", str(path), timeout=120
        )
        assert done.returncode == 0, done.stderr
    waited = controlplane.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    assert waited.returncode == 0, waited.stderr
    return controlplane


class E2E:
    """One test's world: its namespaces, the kubelet serving them, the operator process."""

    def __init__(self, cp: ControlPlane, kubelet: TestKubelet, workdir: Path) -> None:
        self.cp, self.kubelet, self.workdir = cp, kubelet, workdir
        self.namespaces: list[str] = []
        self.operator: subprocess.Popen[bytes] | None = None
        self.operator_starts = 0
        self.settings: dict[str, Any] = {
            "resyncSeconds": 2,
            "progressInterval": 1,
            "progressTimeout": 5,
            "progressUrl": kubelet.progress_url(),
            "errorBackoff": 0.5,
            "errorBackoffMax": 5,
            "drainTimeout": 120,
            "checkpointTimeout": 120,
            "metricsPort": None,
            "livenessPort": None,
        }

    # -- operator ---------------------------------------------------------------------------------

    def start_operator(self, **settings: Any) -> None:
        self.settings.update(settings)
        self.operator_starts += 1
        self.operator = start_operator(
            self.cp.kubeconfig, self.namespaces, self.settings, self.workdir, str(self.operator_starts)
        )

    def kill_operator(self) -> None:
        assert self.operator is not None
        kill(self.operator)
        self.operator = None

    def operator_log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("operator-*.log")))

    # -- jobs -------------------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 60) -> str:
        done = self.cp.kubectl(*args, input=input, check=False, timeout=timeout)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return str(done.stdout)

    def apply(self, doc: dict[str, Any], namespace: str) -> None:
        self.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))

    def job(self, name: str, namespace: str) -> dict[str, Any]:
        return dict(json.loads(self.kubectl("get", "rljob", name, "-n", namespace, "-o", "json")))

    def condition(self, name: str, namespace: str, ctype: str) -> dict[str, Any]:
        conditions = self.job(name, namespace).get("status", {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == ctype), {})

    def wait(self, name: str, namespace: str, condition: str, timeout: int = 300) -> None:
        """`kubectl wait --for=condition=...`, with the pods' and operator's logs when it times out."""
        done = self.cp.kubectl(
            "wait", f"rljob/{name}", "-n", namespace, f"--for=condition={condition}", f"--timeout={timeout}s",
            check=False, timeout=timeout + 30,
        )  # fmt: skip
        if done.returncode != 0:
            status = json.dumps(self.job(name, namespace).get("status"), indent=1)
            pytest.fail(
                f"{name} never {condition}: {done.stderr}\nstatus: {status}\n"
                f"kubelet errors: {self.kubelet.errors}\n--- operator log ---\n{self.operator_log()[-4000:]}\n"
                f"--- pod logs ---\n{self.kubelet.logs()[-8000:]}"
            )

    def events(self, namespace: str) -> list[tuple[str, str]]:
        """(reason, message) of every Kubernetes Event in the namespace, oldest first."""
        items = json.loads(self.kubectl("get", "events", "-n", namespace, "-o", "json"))["items"]
        items.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        return [(e.get("reason", ""), e.get("message", "")) for e in items]

    def restarts_report(self, name: str, namespace: str) -> str:
        """Why the job's training roles restarted: the tails of the logs of every failed pod and every
        replaced coordinator, then the operator's Restarting events (last: a CI log keeps the end)."""
        runs = self.kubelet.started(namespace)
        coordinators = [r.uid for r in runs if r.name == f"{name}-coordinator"]  # in start order
        replaced = set(coordinators[:-1])
        tails = "".join(
            f"--- {log.name} of {r.name} ({r.uid}) ---\n{log.read_text(errors='replace')[-3000:]}\n"
            for r in runs
            if r.phase == "Failed" or r.uid in replaced
            for log in sorted(r.directory.glob("*.log"))
        )
        restarting = [message for reason, message in self.events(namespace) if reason == "Restarting"]
        return f"{tails}\nRestarting events: {restarting}"

    def pods(self, namespace: str) -> dict[str, dict[str, Any]]:
        items = json.loads(self.kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
        return {p["metadata"]["name"]: p for p in items}

    def progress(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The coordinator's /progress, as the operator reads it (through the kubelet's proxy)."""
        url = f"http://127.0.0.1:{self.kubelet.proxy_port}/{namespace}/{name}-coordinator/8000/progress"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return dict(json.loads(r.read()))
        except (OSError, ValueError):
            return None

    def step(self, name: str, namespace: str) -> int:
        """The lowest policy step in the coordinator's /progress (0 before it reports)."""
        doc = self.progress(name, namespace)
        return min((p["step"] for p in doc["policies"]), default=0) if doc else 0

    def counters(self, name: str, namespace: str) -> dict[str, Any]:
        """The last coordinator's final counters line (the last line of its log)."""
        run = self.kubelet.current(namespace, f"{name}-coordinator")
        assert run is not None
        # the job is Succeeded as soon as the operator read the final /progress: let the pod end
        self.eventually(lambda: run.phase != "Running", timeout=60, what=f"{run.name} exiting")
        for line in reversed((run.directory / "main.log").read_text().strip().splitlines()):
            if line.startswith('{"state"'):
                return dict(json.loads(line))
        raise AssertionError(f"no counters line in {run.directory / 'main.log'}")

    def eventually(
        self, check: Callable[[], Any], timeout: float = 180, what: str | Callable[[], str] = ""
    ) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.5)
        what = what() if callable(what) else what
        pytest.fail(f"timed out after {timeout} s waiting for {what or check}\n{self.operator_log()[-3000:]}")


def selfplay(name: str = "selfplay", **spec: Any) -> dict[str, Any]:
    """The 4-pod job of tests/e2e/data, renamed, with ``spec`` fields replaced."""
    doc: dict[str, Any] = yaml.safe_load((E2E_DATA / "selfplay-e2e.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    return doc


def accounted(counters: dict[str, Any]) -> None:
    """No silent loss: every sample produced was trained on (acknowledged), dropped with a reason
    or is still buffered; no episode failed."""
    assert counters["failed"] == {}, counters
    for policy, b in counters["buffers"].items():
        dropped = sum(counters["dropped"][policy].values())
        assert b["produced"] == b["consumed"] + dropped + b["buffered"] + b["leased"], (policy, counters)


@pytest.fixture
def e2e(cluster: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[E2E]:
    kubelet = TestKubelet(cluster.server, [namespace]).start()
    world = E2E(cluster, kubelet, tmp_path)
    world.namespaces.append(namespace)
    try:
        yield world
    finally:
        if world.operator is not None:
            world.operator.terminate()
            world.operator.wait(timeout=30)
        kubelet.stop()
        assert not kubelet.errors, kubelet.errors
