"""The install-lifecycle test's harness: an install rendered and applied, the operator run behind a
recording proxy, and the cluster played through one RLJob's whole life (see test_install_lifecycle.py)."""

from __future__ import annotations

import base64
import copy
import json
import re
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from lupa import lua51

from polyrl_operator import naming
from polyrl_operator.kube import CHILD_API_VERSIONS, path_for
from polyrl_operator.leader import LEASES
from polyrl_operator.planning import render
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv import ControlPlane
from polyrl_testenv.bad_rljobs import CPU_EXAMPLE, EXAMPLES
from polyrl_testenv.controlplane import free_port
from polyrl_testenv.helm import find_helm, render_chart
from polyrl_testenv.install import (
    CHART,
    MANIFESTS,
    kubeconfig_for,
    kustomize_text,
    operator_subject,
    settings_of,
    start_operator,
)
from polyrl_testenv.kueue import admission_status
from polyrl_testenv.operator_fixtures import pod_status
from polyrl_testenv.operator_proc import SyncApi
from polyrl_testenv.request_log import Recorded, RecordingProxy, request_attributes

REPO = MANIFESTS.parent
KUEUE_CRDS = sorted((REPO / "tests" / "data" / "kueue").glob("kueue.x-k8s.io_*.yaml"))
HEALTH_SCRIPT = (MANIFESTS / "argocd" / "health-rljob.lua").read_text()
RLJOBS = "/apis/polyrl.dev/v1alpha1/namespaces/{ns}/rljobs"
# Timings shortened for the test; nothing else of the install's settings is changed.
FAST = {
    "resyncSeconds": 1,
    "progressInterval": 0.5,
    "progressTimeout": 0.5,
    "checkpointTimeout": 1,
    "errorBackoff": 0.2,
    "errorBackoffMax": 1,
}
T = TypeVar("T")


@dataclass(frozen=True)
class Install:
    name: str
    kustomize: str
    example: Path
    chart_values: dict[str, Any]
    namespaced: bool = False
    kueue: bool = False


INSTALLS = {
    "base": Install("base", "base", CPU_EXAMPLE, {}),
    "namespaced": Install(
        "namespaced", "overlays/namespaced", CPU_EXAMPLE, {"rbac": {"scope": "namespaced"}}, namespaced=True
    ),
    "with-kueue": Install(
        "with-kueue",
        "overlays/with-kueue",
        EXAMPLES / "debate-gpu.yaml",
        {"kueue": {"enabled": True}},
        kueue=True,
    ),
}


@dataclass
class Run:
    install: Install
    manifests: list[dict[str, Any]]
    namespaces: list[str]
    chart: list[dict[str, Any]] | None = None
    requests: list[Recorded] = field(default_factory=list)
    snapshots: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)
    """(stage, the live RLJob, the Argo CD health it must have)."""
    tokens: list[str] = field(default_factory=list)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    service_account: dict[str, Any] = field(default_factory=dict)
    network_policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    secret: dict[str, Any] = field(default_factory=dict)
    gitops: dict[str, Any] = field(default_factory=dict)
    log: str = ""
    job: str = ""


def wait_for(check: Callable[[], T | None], what: str, timeout: float = 90.0, log: Path | None = None) -> T:
    """Poll until ``check`` returns a truthy value (the timeout only bounds a hung test)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
            raise AssertionError(f"timed out waiting for {what}\n--- operator log ---\n{tail}")
        time.sleep(0.1)


def health(obj: dict[str, Any]) -> tuple[str, str]:
    """The Argo CD health check, run as Argo CD runs it (Lua 5.1, a global ``obj``)."""
    runtime = lua51.LuaRuntime(unpack_returned_tuples=True)
    runtime.globals().obj = runtime.table_from(json.loads(json.dumps(obj)), recursive=True)
    result = runtime.execute(HEALTH_SCRIPT)
    return str(result["status"]), str(result["message"])


def _is_write(r: Recorded) -> bool:
    """A write to the cluster's objects; the leader's Lease renewals (every retryPeriod, forever)
    are the operator's own bookkeeping, not a change it makes to jobs."""
    return r.method not in ("GET", "HEAD") and "/apis/coordination.k8s.io/" not in r.path


def _writes(proxy: RecordingProxy) -> int:
    return sum(1 for r in proxy.snapshot() if _is_write(r))


def _settled(proxy: RecordingProxy, quiet_s: float = 3.0) -> bool:
    """No write through the proxy for ``quiet_s`` (longer than a resync period of the test settings)."""
    before = _writes(proxy)
    time.sleep(quiet_s)
    return _writes(proxy) == before


def reconciles(port: int) -> float:
    """polyrl_reconciles_total (all results) from the operator's metrics endpoint."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return -1.0
    return sum(
        float(m[1]) for m in re.finditer(r"^polyrl_reconciles_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    )


class Driver:
    """The test's side of the cluster: user, kubelet, Kueue, GitOps tool."""

    def __init__(self, cp: ControlPlane, namespace: str, log: Path) -> None:
        self.cp, self.ns, self.log = cp, namespace, log
        self.api = SyncApi(cp.server)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = self.cp.kubectl(*args, "-n", self.ns, input=input, timeout=120)
        if check:
            assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result

    def job(self, name: str) -> dict[str, Any] | None:
        code, body = self.api.call("GET", f"{RLJOBS.format(ns=self.ns)}/{name}")
        return body if code == 200 else None

    def condition(self, name: str, ctype: str) -> dict[str, Any]:
        job = self.job(name) or {}
        return next((c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})

    def children(self, kinds: tuple[str, ...], job: str) -> dict[tuple[str, str], dict[str, Any]]:
        out = {}
        for kind in kinds:
            path = path_for(CHILD_API_VERSIONS[kind], kind, self.ns)
            for item in self.api.list(path, f"{naming.LABEL_JOB}={job}"):
                out[(kind, item["metadata"]["name"])] = item
        return out

    def pods(self, job: str) -> dict[str, dict[str, Any]]:
        return {name: obj for (kind, name), obj in self.children(("Pod",), job).items()}

    def kubelet(self, job: str, phase: str = "Running", only: set[str] | None = None) -> None:
        for name, pod in self.pods(job).items():
            if (only is None or name in only) and not pod["metadata"].get("deletionTimestamp"):
                code, body = self.api.merge(
                    f"/api/v1/namespaces/{self.ns}/pods/{name}/status", {"status": pod_status(phase)}
                )
                assert code == 200, body

    def wait(self, check: Callable[[], T | None], what: str) -> T:
        return wait_for(check, what, log=self.log)


def rendered_install(install: Install, namespaces: list[str]) -> str:
    text = kustomize_text(MANIFESTS / install.kustomize)
    if install.namespaced:
        # The overlay's example namespaces, replaced by the test's own (what a user edits).
        text = text.replace("team-a", namespaces[0]).replace("team-b", namespaces[1])
    return text


def chart_install(install: Install, namespaces: list[str]) -> list[dict[str, Any]] | None:
    if find_helm()[0] is None:
        return None
    values = copy.deepcopy(install.chart_values)
    if install.namespaced:
        values["watchNamespaces"] = namespaces
    return render_chart(CHART, values)


def apply_manifests(cp: ControlPlane, text: str) -> None:
    """Apply a rendering as it was printed (not re-serialised: PyYAML would read kustomize's
    ``1e-06`` as a string and write it back quoted)."""
    result = cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text, timeout=120)
    assert result.returncode == 0, result.stderr
    waited = cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    assert waited.returncode == 0, waited.stderr


def delete_manifests(cp: ControlPlane, manifests: list[dict[str, Any]]) -> None:
    keep = {"CustomResourceDefinition", "Namespace"}  # shared by the whole session
    text = yaml.safe_dump_all([m for m in manifests if m["kind"] not in keep])
    cp.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=text, timeout=120)


def example_priority_class(install: Install) -> dict[str, Any]:
    name = yaml.safe_load(install.example.read_text())["spec"]["scheduling"]["priorityClassName"]
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name},
        "value": 1000,
    }


def example_doc(path: Path, namespace: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    doc["metadata"]["namespace"] = namespace
    return doc


def run_lifecycle(cp: ControlPlane, install: Install, workdir: Path) -> Run:
    namespaces = [f"t-install-{install.name}-{uuid.uuid4().hex[:6]}", f"t-install-b-{uuid.uuid4().hex[:6]}"]
    for ns in namespaces:
        cp.create_namespace(ns)
    if install.kueue:
        for crd in KUEUE_CRDS:
            result = cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd), timeout=120)
            assert result.returncode == 0, result.stderr
        # The class the example's spec.scheduling.priorityClassName names, as a PriorityClass: the
        # operator looks for a WorkloadPriorityClass of that name first, then finds this one.
        code, body = cp.request(
            "POST", "/apis/scheduling.k8s.io/v1/priorityclasses", example_priority_class(install)
        )
        assert code in (201, 409), body
    text = rendered_install(install, namespaces)
    manifests = [d for d in yaml.safe_load_all(text) if d]
    run = Run(install, manifests, namespaces, chart=chart_install(install, namespaces))
    apply_manifests(cp, text)
    settings = OperatorSettings.model_validate({**settings_of(manifests), **FAST})
    # A fresh install has no leader Lease yet (an earlier install in this control plane left one).
    lease_ns = settings.leader_election.lease_namespace or operator_subject(manifests)[0]
    cp.request("DELETE", f"{LEASES.format(namespace=lease_ns)}/{settings.leader_election.lease_name}")
    try:
        with RecordingProxy(cp.server) as proxy:
            kubeconfig = kubeconfig_for(proxy.url, workdir / "kubeconfig")
            metrics_port = free_port()
            proc, log = start_operator(
                manifests,
                kubeconfig=kubeconfig,
                workdir=workdir,
                overrides=FAST,
                metrics_port=metrics_port,
                verbose=True,
            )
            try:
                _drive(
                    cp,
                    run,
                    settings=settings,
                    ns=namespaces[0],
                    log=log,
                    proxy=proxy,
                    metrics_port=metrics_port,
                )
            finally:
                proc.terminate()
                proc.wait(30)
            run.requests = proxy.snapshot()
            run.log = log.read_text(errors="replace")
    finally:
        delete_manifests(cp, manifests)
        for ns in namespaces:
            cp.delete_namespace(ns)
    return run


def _drive(
    cp: ControlPlane,
    run: Run,
    *,
    settings: OperatorSettings,
    ns: str,
    log: Path,
    proxy: RecordingProxy,
    metrics_port: int,
) -> None:
    d = Driver(cp, ns, log)
    doc = example_doc(run.install.example, ns)
    name = run.job = doc["metadata"]["name"]
    manifest = workdir_file(log.parent / "job.yaml", doc)
    d.kubectl("apply", "-f", str(manifest))

    # Pending: the operator picked the job up (finalizer, status) but it is not running.
    job = d.wait(lambda: (j := d.job(name)) and (j.get("status") or {}).get("phase") and j, "a status")
    run.snapshots.append(("created", job, "Progressing"))
    kinds = settings.child_kinds()
    if run.install.kueue:
        workload_path = f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads/{naming.workload(name)}"
        workload = d.wait(lambda: (r := d.api.call("GET", workload_path))[0] == 200 and r[1], "the Workload")
        assert d.pods(name) == {}, "pods before Kueue admitted the Workload"
        run.snapshots.append(("awaiting-admission", d.job(name) or {}, "Progressing"))
        _admit(d, workload, workload_path)

    # Every child the operator renders for this job exists (the install's settings, live uid).
    live_job = d.job(name) or {}
    expected = {(m["kind"], m["metadata"]["name"]): m for m in render(live_job, settings, namespace=ns)}
    d.wait(lambda: set(d.children(kinds, name)) == set(expected), "the job's children")
    d.kubelet(name)
    d.wait(lambda: d.condition(name, "Ready").get("status") == "True", "Ready")
    running = d.job(name) or {}
    assert running["status"]["phase"] == "Running"
    run.snapshots.append(("running", running, "Healthy"))
    children = d.children(kinds, name)
    run.pods = {n: o for (k, n), o in children.items() if k == "Pod"}
    run.service_account = children[("ServiceAccount", naming.service_account(name))]
    run.network_policies = {n: o for (k, n), o in children.items() if k == "NetworkPolicy"}
    run.secret = children[("Secret", naming.secret(name))]
    run.tokens.append(base64.b64decode(run.secret["data"][naming.TOKEN_KEY]).decode())

    # GitOps: the same manifest applied again (client-side and server-side) changes nothing. First the
    # operator settles: on a loaded machine its last write for the Ready job can land after Ready shows.
    d.wait(lambda: _settled(proxy), "the operator to stop writing")
    children = d.children(kinds, name)
    before_requests = len(proxy.snapshot())
    before_count = reconciles(metrics_port)
    d.kubectl("apply", "-f", str(manifest))
    d.kubectl("apply", "--server-side", "-f", str(manifest))
    diff = d.kubectl("diff", "-f", str(manifest), check=False)
    d.wait(lambda: reconciles(metrics_port) >= before_count + 3, "three more reconciles")
    after = d.job(name) or {}
    run.gitops = {
        "generation": (running["metadata"]["generation"], after["metadata"]["generation"]),
        "children": (
            {k: o["metadata"]["resourceVersion"] for k, o in children.items()},
            {k: o["metadata"]["resourceVersion"] for k, o in d.children(kinds, name).items()},
        ),
        "writes": [
            str(request_attributes(r.method, r.path, r.query))
            for r in proxy.snapshot()[before_requests:]
            if _is_write(r)
        ],
        "diff": (diff.returncode, diff.stdout + diff.stderr),
    }

    # Children edited by hand (their content hash no longer matches) are patched back.
    for kind in kinds:
        if kind in ("Pod", "Workload"):
            continue
        key = next(k for k in children if k[0] == kind)
        path = path_for(CHILD_API_VERSIONS[kind], kind, ns, key[1])
        code, body = d.api.merge(path, {"metadata": {"annotations": {naming.ANNOTATION_HASH: "edited"}}})
        assert code == 200, body
        want = expected[key]["metadata"]["annotations"][naming.ANNOTATION_HASH]

        def restored(path: str = path, want: str = want) -> bool:
            return bool(d.api.call("GET", path)[1]["metadata"]["annotations"][naming.ANNOTATION_HASH] == want)

        d.wait(restored, f"{kind} restored")

    # Suspend: a checkpoint is asked of the coordinator (pod annotation), then the pods go.
    d.kubectl("patch", "rljob", name, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    d.wait(lambda: d.condition(name, "Suspended").get("status") == "True", "Suspended")
    assert d.pods(name) == {}
    run.snapshots.append(("suspended", d.job(name) or {}, "Suspended"))
    d.kubectl("patch", "rljob", name, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    d.wait(lambda: len(d.pods(name)) == sum(1 for k in expected if k[0] == "Pod"), "pods recreated")
    d.kubelet(name)
    d.wait(lambda: d.condition(name, "Ready").get("status") == "True", "Ready again")

    # The coordinator exits 0: Succeeded; then a TTL makes the operator delete the job and its children.
    d.kubelet(name, "Succeeded", only={naming.coordinator_pod(name)})
    d.wait(lambda: d.condition(name, "Succeeded").get("status") == "True", "Succeeded")
    run.snapshots.append(("succeeded", d.job(name) or {}, "Healthy"))
    d.kubectl("patch", "rljob", name, "--type=merge", "-p", '{"spec":{"ttlSecondsAfterFinished":0}}')
    d.wait(lambda: d.job(name) is None, "the job deleted after its TTL")
    d.wait(lambda: not d.children(kinds, name), "every child deleted")

    # A job this operator cannot run: Failed (InvalidSpec), Degraded for Argo CD; deleted by the user.
    bad = _invalid_job(run.install, ns)
    bad_name = bad["metadata"]["name"]
    d.kubectl("apply", "-f", str(workdir_file(log.parent / "bad.yaml", bad)))
    d.wait(lambda: d.condition(bad_name, "Failed").get("status") == "True", "InvalidSpec")
    run.snapshots.append(("invalid", d.job(bad_name) or {}, "Degraded"))
    d.kubectl("delete", "rljob", bad_name, "--wait=false")
    d.wait(lambda: d.job(bad_name) is None, "the invalid job deleted")


def _admit(d: Driver, workload: dict[str, Any], path: str) -> None:
    """Play Kueue: a ResourceFlavor, and an admission of every podSet with it."""
    flavor: dict[str, Any] = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ResourceFlavor",
        "metadata": {"name": f"gpu-{d.ns}"},
        "spec": {"nodeLabels": {"cloud.example.com/pool": "gpu"}},
    }
    code, body = d.api.call("POST", "/apis/kueue.x-k8s.io/v1beta2/resourceflavors", flavor)
    assert code == 201, body
    podsets = [(ps["name"], ps["count"]) for ps in workload["spec"]["podSets"]]
    name = flavor["metadata"]["name"]
    status = admission_status("gpu-queue", podsets, {"nvidia.com/gpu": name, "cpu": name})
    code, body = d.api.merge(f"{path}/status", {"status": status})
    assert code == 200, body


def _invalid_job(install: Install, ns: str) -> dict[str, Any]:
    if not install.kueue:
        # The GPU example names a Kueue queue; this install's Kueue integration is off.
        doc = example_doc(EXAMPLES / "debate-gpu.yaml", ns)
    else:
        doc = example_doc(CPU_EXAMPLE, ns)
        doc["spec"]["workflow"]["podTemplate"] = {"metadata": {"labels": {naming.LABEL_JOB: "x"}}}
    doc["metadata"]["name"] = "rejected"
    return doc


def workdir_file(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path
