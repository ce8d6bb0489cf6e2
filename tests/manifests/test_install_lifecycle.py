"""Install as a cluster admin would, then run jobs through it, with the real operator process.

For each install (kustomize ``base``, ``overlays/namespaced``, ``overlays/with-kueue``): render it
with the real kustomize, apply it to the control plane, and run ``polyrl operator`` exactly as the
rendered Deployment does (its args, its settings ConfigMap, its ServiceAccount's namespace) behind a
proxy that records every request it sends. The test then plays the cluster (kubelet, Kueue, a user,
a GitOps tool) through one RLJob's whole life: create -> (Kueue admission) -> running -> re-applied
unchanged -> children drifted by hand -> suspended -> resumed -> succeeded -> deleted by its TTL;
and a second job the operator must reject.

What the recorded run is then checked for (one test each):
* RBAC: every request the operator sent is allowed by the install's Role/ClusterRole (and the Helm
  chart's for the same options), and every verb granted was used: exactly what it needs, no more.
  The control plane enforces no RBAC, which is why the requests are checked against the rules.
* Argo CD: the shipped Lua health check on the live RLJob at each stage.
* GitOps: re-applying the unchanged manifest is a no-op (no generation bump, no child change, no
  operator write) and ``kubectl diff`` shows nothing the operator wrote as drift.
* Job pods: their own ServiceAccount (no token, no binding), the restricted security context, the
  Ray token only from the job's Secret, the job's NetworkPolicies.
* Secrets: the job's Ray token never appears in the operator's log (run with --verbose).
"""

from __future__ import annotations

import base64
import copy
import json
import re
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from lupa import lua51

from polyrl_operator import naming
from polyrl_operator.kube import CHILD_API_VERSIONS, path_for
from polyrl_operator.main import render
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv import ControlPlane
from polyrl_testenv.bad_rljobs import CPU_EXAMPLE, EXAMPLES
from polyrl_testenv.controlplane import free_port
from polyrl_testenv.helm import find_helmrender, render_chart
from polyrl_testenv.install import (
    CHART,
    MANIFESTS,
    kubeconfig_for,
    kustomize_text,
    operator_subject,
    settings_of,
    start_operator,
    without_crds,
)
from polyrl_testenv.kueue import admission_status
from polyrl_testenv.operator_fixtures import pod_status
from polyrl_testenv.operator_proc import SyncApi
from polyrl_testenv.request_log import Authorizer, Recorded, RecordingProxy, request_attributes

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

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


def _writes(proxy: RecordingProxy) -> int:
    return sum(1 for r in proxy.snapshot() if r.method not in ("GET", "HEAD"))


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
    if find_helmrender()[0] is None:
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
    text = rendered_install(install, namespaces)
    manifests = [d for d in yaml.safe_load_all(text) if d]
    run = Run(install, manifests, namespaces, chart=chart_install(install, namespaces))
    apply_manifests(cp, text)
    settings = OperatorSettings.model_validate({**settings_of(manifests), **FAST})
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
            if r.method not in ("GET", "HEAD")
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
        d.wait(
            lambda path=path, want=want: (
                d.api.call("GET", path)[1]["metadata"]["annotations"][naming.ANNOTATION_HASH] == want
            ),
            f"{kind} restored",
        )

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
    flavor = {
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


@pytest.fixture(scope="module", params=list(INSTALLS))
def lifecycle(
    request: pytest.FixtureRequest, controlplane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Run]:
    install = INSTALLS[request.param]
    yield run_lifecycle(controlplane, install, tmp_path_factory.mktemp(f"install-{install.name}"))


# ---- RBAC -----------------------------------------------------------------------------------------


def _check_rbac(run: Run, manifests: list[dict[str, Any]]) -> list[str]:
    subject = operator_subject(manifests)
    authz = Authorizer(manifests, *subject)
    assert authz.bound, f"no binding names the operator's ServiceAccount {subject}"
    problems: list[str] = []
    used: set[tuple[str, str, str]] = set()
    for recorded in run.requests:
        attrs = request_attributes(recorded.method, recorded.path, recorded.query)
        if authz.allows(attrs) is None:
            problems.append(f"DENIED: {attrs}   ({recorded.method} {recorded.path}?{recorded.query})")
        if attrs.resource_request:
            used.add(attrs.grant)
    for source, grant, _ in authz.granted():
        if "*" in grant:
            problems.append(f"WILDCARD in {source}: {grant}")
        elif grant not in used:
            problems.append(f"UNUSED grant in {source}: {grant} (the operator never needed it)")
    return sorted(set(problems))


def test_rbac_grants_exactly_what_the_operator_uses(lifecycle: Run) -> None:
    assert len(lifecycle.requests) > 50, "too few requests recorded: is the proxy in the path?"
    problems = _check_rbac(lifecycle, lifecycle.manifests)
    assert not problems, "kustomize " + lifecycle.install.kustomize + ":\n" + "\n".join(problems)


def test_chart_rbac_grants_exactly_what_the_operator_uses(lifecycle: Run) -> None:
    if lifecycle.chart is None:
        pytest.skip(f"HELM RENDERER NOT AVAILABLE: {find_helmrender()[1]}")
    problems = _check_rbac(lifecycle, lifecycle.chart)
    assert not problems, f"chart {lifecycle.install.chart_values}:\n" + "\n".join(problems)


def test_namespaced_install_reads_nothing_cluster_scoped(lifecycle: Run) -> None:
    if not lifecycle.install.namespaced:
        pytest.skip("cluster-wide install")
    cluster_scoped = sorted(
        {
            str(attrs)
            for r in lifecycle.requests
            if (attrs := request_attributes(r.method, r.path, r.query)).resource_request
            and not attrs.namespace
        }
    )
    assert cluster_scoped == []
    assert not [m for m in lifecycle.manifests if m["kind"] in ("ClusterRole", "ClusterRoleBinding")]


# ---- Argo CD health on live objects ---------------------------------------------------------------


def test_argocd_health_of_live_rljobs(lifecycle: Run) -> None:
    stages = [stage for stage, _, _ in lifecycle.snapshots]
    assert {"created", "running", "suspended", "succeeded", "invalid"} <= set(stages)
    for stage, obj, expected in lifecycle.snapshots:
        status, message = health(obj)
        assert (stage, status) == (stage, expected), (
            f"{stage}: {message}\n{json.dumps(obj.get('status'), indent=1)}"
        )
        assert message


# ---- GitOps ---------------------------------------------------------------------------------------


def test_reapplying_the_unchanged_job_is_a_noop(lifecycle: Run) -> None:
    gitops = lifecycle.gitops
    before, after = gitops["generation"]
    assert before == after, "re-applying the same manifest bumped the generation"
    old, new = gitops["children"]
    assert old == new, "children changed although nothing did"
    assert gitops["writes"] == [], "the operator wrote although nothing changed"
    code, output = gitops["diff"]
    assert code == 0, f"kubectl diff shows drift the operator wrote:\n{output}"


# ---- Job pods: identity, security context, token, network ------------------------------------------


def test_job_pods_run_as_their_own_unprivileged_service_account(lifecycle: Run) -> None:
    job = lifecycle.job
    sa = lifecycle.service_account
    assert sa["metadata"]["name"] == naming.service_account(job)
    assert sa.get("automountServiceAccountToken") is False
    for manifests in (lifecycle.manifests, lifecycle.chart or []):
        bound = {
            s["name"]
            for m in manifests
            if m["kind"] in ("RoleBinding", "ClusterRoleBinding")
            for s in m.get("subjects") or []
        }
        assert sa["metadata"]["name"] not in bound
    assert lifecycle.pods
    for name, pod in lifecycle.pods.items():
        spec = pod["spec"]
        assert spec["serviceAccountName"] == sa["metadata"]["name"], name
        assert spec["automountServiceAccountToken"] is False, name


def test_job_pods_meet_the_restricted_pod_security_standard(lifecycle: Run) -> None:
    for name, pod in lifecycle.pods.items():
        spec = pod["spec"]
        sec = spec["securityContext"]
        assert sec["runAsNonRoot"] is True and sec["runAsUser"] > 0, name
        assert sec["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), name
        for volume in spec["volumes"]:
            assert "hostPath" not in volume, name
        for container in spec["containers"] + spec.get("initContainers", []):
            csec = container["securityContext"]
            assert csec["allowPrivilegeEscalation"] is False, name
            assert csec["capabilities"]["drop"] == ["ALL"] and not csec["capabilities"].get("add"), name
            assert csec.get("privileged") in (None, False), name
            assert csec["readOnlyRootFilesystem"] is True, name
            writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
            assert "/tmp" in writable, name
            env = {e["name"]: e for e in container["env"]}
            assert env["TMPDIR"]["value"].startswith("/tmp"), name


def test_ray_token_comes_only_from_the_jobs_secret(lifecycle: Run) -> None:
    [token] = lifecycle.tokens
    assert len(token) >= 32
    secret_name = lifecycle.secret["metadata"]["name"]
    for name, pod in lifecycle.pods.items():
        text = json.dumps(pod)
        assert token not in text, f"{name} carries the token itself"
        [container] = pod["spec"]["containers"]
        [ref] = [e for e in container["env"] if e["name"] == "RAY_AUTH_TOKEN"]
        assert "value" not in ref
        assert ref["valueFrom"] == {"secretKeyRef": {"name": secret_name, "key": naming.TOKEN_KEY}}
        command_line = [*(container.get("command") or []), *(container.get("args") or [])]
        assert command_line and not any("TOKEN" in a.upper() for a in command_line)


def test_job_network_policies_admit_only_the_job_and_the_operator(lifecycle: Run) -> None:
    job = lifecycle.job
    policies = lifecycle.network_policies
    assert set(policies) == {naming.network_policy(job), naming.progress_network_policy(job)}
    isolation = policies[naming.network_policy(job)]["spec"]
    assert isolation["podSelector"] == {"matchLabels": {naming.LABEL_JOB: job}}
    assert isolation["policyTypes"] == ["Ingress"]
    assert isolation["ingress"] == [{"from": [{"podSelector": {"matchLabels": {naming.LABEL_JOB: job}}}]}]
    # Every pod of the job is selected by the isolation policy.
    for name, pod in lifecycle.pods.items():
        assert pod["metadata"]["labels"][naming.LABEL_JOB] == job, name
    progress = policies[naming.progress_network_policy(job)]["spec"]
    coordinator = lifecycle.pods[naming.coordinator_pod(job)]
    selected = [
        n for n, p in lifecycle.pods.items()
        if progress["podSelector"]["matchLabels"].items() <= p["metadata"]["labels"].items()
    ]  # fmt: skip
    assert selected == [coordinator["metadata"]["name"]]
    [rule] = progress["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": naming.PORT_HTTP}]
    [peer] = rule["from"]
    # The peer is exactly the operator's pods, in the operator's namespace, as the install deploys them.
    for manifests in (lifecycle.manifests, lifecycle.chart or []):
        if not manifests:
            continue
        namespace, _ = operator_subject(manifests)
        deployment = next(m for m in manifests if m["kind"] == "Deployment")
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        if manifests is lifecycle.manifests:
            assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
            assert peer["podSelector"]["matchLabels"].items() <= pod_labels.items()
        else:
            chart_np = yaml.safe_load(
                next(m for m in manifests if m["kind"] == "ConfigMap")["data"]["settings.yaml"]
            )["networkPolicy"]
            assert chart_np["operatorNamespace"] == namespace
            assert chart_np["operatorPodLabels"].items() <= pod_labels.items()


# ---- Secrets never logged -------------------------------------------------------------------------


def test_the_ray_token_is_never_logged(lifecycle: Run) -> None:
    assert lifecycle.log.count("\n") > 20, "the operator log is (nearly) empty: was --verbose passed?"
    for token in lifecycle.tokens:
        for variant in {token, base64.b64encode(token.encode()).decode()}:
            assert variant not in lifecycle.log, "the Ray token appears in the operator log"


def test_each_install_applies_without_crd_drift(lifecycle: Run) -> None:
    # The install was applied (in run_lifecycle); its CRD is the generated one (kustomize only adds
    # the part-of label).
    [crd] = [m for m in lifecycle.manifests if m["kind"] == "CustomResourceDefinition"]
    generated = yaml.safe_load((REPO / "crds" / "polyrl.dev_rljobs.yaml").read_text())
    assert crd["metadata"].pop("labels") == {"app.kubernetes.io/part-of": "polyrl"}
    assert json_numbers(crd) == json_numbers(generated)


def json_numbers(node: Any) -> Any:
    """Numbers as the API server reads them: kustomize prints 1.0 as 1 and 1.0e-06 as 1e-06 (which
    PyYAML, a YAML 1.1 parser, reads as a string; Kubernetes' YAML reader reads a number)."""
    if isinstance(node, dict):
        return {k: json_numbers(v) for k, v in node.items()}
    if isinstance(node, list):
        return [json_numbers(v) for v in node]
    if isinstance(node, bool):
        return node
    if isinstance(node, int | float):
        return float(node)
    if isinstance(node, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", node):
        return float(node)
    return node
    assert without_crds(lifecycle.manifests)
