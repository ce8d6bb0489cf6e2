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
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from polyrl_operator import naming
from polyrl_operator.pod_contract import PORT_HTTP
from polyrl_testenv import ControlPlane
from polyrl_testenv.helm import find_helm
from polyrl_testenv.install import (
    operator_subject,
    without_crds,
)
from polyrl_testenv.lifecycle import (
    INSTALLS,
    REPO,
    Run,
    health,
    run_lifecycle,
)
from polyrl_testenv.request_log import Authorizer, request_attributes

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]


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
        pytest.skip(f"HELM NOT AVAILABLE: {find_helm()[1]}")
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
    assert rule["ports"] == [{"protocol": "TCP", "port": PORT_HTTP}]
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
