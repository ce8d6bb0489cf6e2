"""The Helm chart: values against their schema, Chart.yaml, the README's values table, ``helm lint
--strict``, and the templates rendered by the genuine ``helm template`` (hack/helm/prepare.sh) for the
defaults and every documented option, each checked against the operator's own code and the kustomize
install, applied to the control plane, and installed, upgraded and uninstalled there by ``helm``."""

from __future__ import annotations

import contextlib
import json
import re
import tomllib
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from polyrl_operator.cli import build_parser
from polyrl_operator.kube import PLURALS
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv import ControlPlane
from polyrl_testenv.bad_rljobs import EXAMPLES, REPO
from polyrl_testenv.helm import HelmError, find_helm, helm, release_args, render_chart, render_chart_text
from polyrl_testenv.install import (
    CHART,
    MANIFESTS,
    assert_apply_is_idempotent,
    assert_examples_apply,
    find,
    kubectl_binary,
    kustomize,
    one,
    operator_container,
    operator_deployment,
    operator_subject,
    settings_of,
)

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
RBAC_GROUPS = {"": "", "polyrl.dev": "polyrl.dev", "networking.k8s.io": "", "kueue.x-k8s.io": ""}

# Every option the README documents, as a user would set it.
OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "image": {"image": {"repository": "registry.example.com/polyrl-operator", "tag": "1.2.3", "pullPolicy": "Always"},
              "imagePullSecrets": [{"name": "regcred"}], "runtimeImage": "registry.example.com/polyrl-runtime:1.2.3"},
    "namespaced": {"rbac": {"scope": "namespaced"}, "watchNamespaces": ["team-a", "team-b"]},
    "namespaced-kueue": {"rbac": {"scope": "namespaced"}, "watchNamespaces": ["team-a"], "kueue": {"enabled": True}},
    "kueue-gpus": {"kueue": {"enabled": True}, "gpuTypes": {"h100": {
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}},
    "no-networkpolicy": {"networkPolicy": {"enabled": False, "extraIngress": []}},
    "extra-ingress": {"networkPolicy": {"enabled": True, "extraIngress": [
        {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}]}},
    "servicemonitor": {"metrics": {"enabled": True, "port": 9100, "serviceMonitor": {
        "enabled": True, "interval": "15s", "labels": {"release": "kube-prometheus-stack"}}}},
    "no-metrics": {"metrics": {"enabled": False, "port": 9090, "serviceMonitor": {"enabled": True, "interval": "30s"}}},
    "scheduling": {"resources": {"requests": {"cpu": "200m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
                   "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
                   "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
                   "priorityClassName": "system-cluster-critical", "podLabels": {"team": "ml-platform"},
                   "podAnnotations": {"example.com/owner": "ml-platform"}},
    "extra-settings": {"extraSettings": {"resyncSeconds": 60, "drainTimeout": 120,
                                         "podSecurity": {"runAsUser": 2000, "runAsGroup": 2000, "fsGroup": 2000}}},
    "names": {"nameOverride": "rl", "serviceAccount": {"create": True, "name": "rl-operator-sa",
              "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/polyrl"}}},
    "fullname": {"fullnameOverride": "polyrl-controller"},
    "own-serviceaccount": {"serviceAccount": {"create": False, "name": "platform-operator", "annotations": {}},
                           "rbac": {"scope": "cluster", "aggregateToDefaultRoles": False}},
    "replicas": {"replicas": 2, "leaderElection": {"enabled": True}},
    "single-no-election": {"replicas": 1, "leaderElection": {"enabled": False}},
    "security-contexts": {"podSecurityContext": {"runAsNonRoot": True, "runAsUser": 65532, "fsGroup": 65532},
                          "securityContext": {"allowPrivilegeEscalation": False, "privileged": False}},
}  # fmt: skip
BAD_VALUES: dict[str, dict[str, Any]] = {
    "namespaced-without-namespaces": {"rbac": {"scope": "namespaced"}},
    "namespaces-without-namespaced": {"watchNamespaces": ["team-a"]},
    "unknown-scope": {"rbac": {"scope": "everything"}},
    "unknown-key": {"replica": 2},
    "replicas-without-leader-election": {"replicas": 2, "leaderElection": {"enabled": False}},
    "zero-replicas": {"replicas": 0},
    "existing-serviceaccount-without-name": {
        "serviceAccount": {"create": False, "name": "", "annotations": {}}
    },
    "bad-fullname": {"fullnameOverride": "Polyrl_Operator"},
    "setting-owned-by-leader-election": {"extraSettings": {"leaderElection": {"enabled": False}}},
    "setting-owned-by-a-value": {"extraSettings": {"defaultImage": "x"}},
    "bad-namespace": {"rbac": {"scope": "namespaced"}, "watchNamespaces": ["Team_A"]},
    "bad-port": {
        "metrics": {"enabled": True, "port": 0, "serviceMonitor": {"enabled": False, "interval": "30s"}}
    },
}

needs_helm = pytest.mark.skipif(find_helm()[0] is None, reason=f"HELM NOT AVAILABLE: {find_helm()[1]}")


def merged(values: dict[str, Any]) -> dict[str, Any]:
    """values.yaml with ``values`` over it (helm's coalescing, for these plain maps)."""

    def merge(base: Any, over: Any) -> Any:
        if isinstance(base, dict) and isinstance(over, dict):
            return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
        return over

    out: dict[str, Any] = merge(VALUES, values)
    return out


# ---- static ---------------------------------------------------------------------------------------


def test_chart_yaml_is_well_formed() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "polyrl" and chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    operator_version = tomllib.loads((REPO / "operator" / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == operator_version  # the operator image tag the chart deploys
    base_image = operator_container(kustomize(MANIFESTS / "base"))["image"] if kubectl_binary() else None
    if base_image is not None:
        assert base_image.endswith(f":{chart['appVersion']}")


def test_values_validate_against_the_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.validate(VALUES, SCHEMA)
    for name, values in OPTIONS.items():
        try:
            jsonschema.validate(merged(values), SCHEMA)
        except jsonschema.ValidationError as exc:  # pragma: no cover - message for the failure
            raise AssertionError(f"documented option {name!r} is refused: {exc.message}") from exc


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_schema_refuses_bad_values(name: str) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged(BAD_VALUES[name]), SCHEMA)


def test_defaults_agree_with_the_operator_code() -> None:
    defaults = OperatorSettings()
    assert VALUES["runtimeImage"] == defaults.default_image
    assert VALUES["networkPolicy"]["enabled"] == defaults.network_policy.enabled
    assert VALUES["metrics"]["port"] == defaults.metrics_port
    assert VALUES["livenessPort"] == defaults.liveness_port


WHOLE_OBJECTS = ("resources", "gpuTypes", "podSecurityContext", "securityContext")
"""Values documented as one object in the README's table, not key by key."""


def _leaves(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and value and full not in WHOLE_OBJECTS:
            out.update(_leaves(value, full + "."))
        else:
            out[full] = value
    return out


def test_readme_values_table_matches_values_yaml() -> None:
    readme = (CHART / "README.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| (\w+) \| `(.*?)` \| (.+) \|$", readme, re.M)
    table = {key: json.loads(default) for key, _, default, _ in rows}
    assert table == _leaves(VALUES)
    # Every top-level key of the schema is documented, and vice versa.
    assert {k.split(".")[0] for k in table} == set(SCHEMA["properties"])
    assert "kubectl apply --server-side -f charts/polyrl/crds/" in readme


def test_crds_folder_is_only_the_generated_crd() -> None:
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == ["polyrl.dev_rljobs.yaml"]
    assert (CHART / "crds" / "polyrl.dev_rljobs.yaml").read_bytes() == (
        REPO / "crds" / "polyrl.dev_rljobs.yaml"
    ).read_bytes()


# ---- rendered -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def renderings() -> dict[str, list[dict[str, Any]]]:
    if find_helm()[0] is None:
        pytest.skip(f"HELM NOT AVAILABLE: {find_helm()[1]}")
    return {name: render_chart(CHART, values) for name, values in OPTIONS.items()}


def _bound(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Roles and ClusterRoles bound to the operator's ServiceAccount (not the aggregated
    view/edit roles, which are for namespace users)."""
    namespace, account = operator_subject(docs)
    refs = {
        (b["roleRef"]["kind"], b["roleRef"]["name"], b["metadata"].get("namespace", ""))
        for b in find(docs, "ClusterRoleBinding") + find(docs, "RoleBinding")
        if {"kind": "ServiceAccount", "name": account, "namespace": namespace} in b["subjects"]
    }
    return [
        r
        for r in find(docs, "ClusterRole") + find(docs, "Role")
        if (
            r["kind"],
            r["metadata"]["name"],
            r["metadata"].get("namespace", "") if r["kind"] == "Role" else "",
        )
        in {(k, n, ns if k == "Role" else "") for k, n, ns in refs}
    ]


def _rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _granted(docs: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {grant for role in _bound(docs) for grant in _rules(role)}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_rendering_is_consistent_with_the_operator(
    renderings: dict[str, list[dict[str, Any]]], name: str
) -> None:
    docs = renderings[name]
    values = merged(OPTIONS[name])
    settings = OperatorSettings.model_validate(settings_of(docs))
    assert settings.default_image == values["runtimeImage"]
    assert settings.kueue.enabled == values["kueue"]["enabled"]
    assert settings.network_policy.enabled == values["networkPolicy"]["enabled"]
    assert settings.network_policy.extra_ingress == values["networkPolicy"]["extraIngress"]
    assert set(settings.gpu_types) == set(values["gpuTypes"])
    for key, value in values["extraSettings"].items():
        assert settings_of(docs)[key] == value
    namespace, account = operator_subject(docs)
    assert settings.network_policy.operator_namespace == namespace == "polyrl-system"
    pod = operator_deployment(docs)["spec"]["template"]
    assert settings.network_policy.operator_pod_labels.items() <= pod["metadata"]["labels"].items()
    assert one(docs, "ServiceAccount", account) if values["serviceAccount"]["create"] else True

    container = operator_container(docs)
    args = build_parser().parse_args(["operator", *container["args"]])
    tag = values["image"]["tag"] or yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert container["image"] == f"{values['image']['repository']}:{tag}"
    # RBAC: exactly the kinds the operator manages with these settings.
    granted = _granted(docs)
    resources = {r for _, r, _ in granted}
    children = {PLURALS[k] for k in settings.child_kinds()}
    expected = children | {"rljobs", "rljobs/status", "events"}
    if values["leaderElection"]["enabled"]:
        expected.add("leases")
        assert settings.leader_election.lease_namespace == "polyrl-system"
        assert settings.leader_election.lease_name == operator_deployment(docs)["metadata"]["name"]
    assert settings.leader_election.enabled == values["leaderElection"]["enabled"]
    if settings.kueue.enabled:
        expected |= {"resourceflavors", "workloadpriorityclasses", "priorityclasses"}
    if values["rbac"]["scope"] == "cluster":
        expected.add("customresourcedefinitions")
        assert args.all_namespaces
        assert all(r["metadata"]["namespace"] == "polyrl-system" for r in find(docs, "Role"))
    else:
        assert set(args.namespace) == set(values["watchNamespaces"])
        watched = {r["metadata"]["namespace"] for r in find(docs, "Role") if "leases" not in str(r["rules"])}
        assert watched == set(values["watchNamespaces"])
        cluster = _granted([d for d in docs if d["kind"] != "Role"])
        kueue_reads = {
            ("kueue.x-k8s.io", "resourceflavors", "get"),
            ("kueue.x-k8s.io", "workloadpriorityclasses", "get"),
            ("scheduling.k8s.io", "priorityclasses", "get"),
        }
        assert cluster == (kueue_reads if settings.kueue.enabled else set())
    assert resources == expected
    assert not any("*" in g for g in granted)
    # Metrics.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    if values["metrics"]["enabled"]:
        assert args.metrics_port == ports["metrics"] == values["metrics"]["port"]
        service = one(docs, "Service")
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    else:
        assert args.metrics_port == 0 and not find(docs, "Service") and not find(docs, "ServiceMonitor")
    monitors = find(docs, "ServiceMonitor")
    assert bool(monitors) == (values["metrics"]["enabled"] and values["metrics"]["serviceMonitor"]["enabled"])
    for monitor in monitors:
        assert (
            monitor["spec"]["selector"]["matchLabels"].items()
            <= one(docs, "Service")["metadata"]["labels"].items()
        )
        assert monitor["spec"]["endpoints"][0]["interval"] == values["metrics"]["serviceMonitor"]["interval"]
        assert values["metrics"]["serviceMonitor"]["labels"].items() <= monitor["metadata"]["labels"].items()
    # Scheduling of the operator pod.
    spec = pod["spec"]
    assert spec.get("nodeSelector", {}) == values["nodeSelector"]
    assert spec.get("tolerations", []) == values["tolerations"]
    assert spec.get("priorityClassName", "") == values["priorityClassName"]
    assert container["resources"] == values["resources"]
    assert values["podLabels"].items() <= pod["metadata"]["labels"].items()
    assert spec.get("imagePullSecrets", []) == values["imagePullSecrets"]
    # Names, ServiceAccount, replicas and security contexts.
    fullname = values["fullnameOverride"] or f"polyrl-{values['nameOverride'] or 'operator'}"
    assert operator_deployment(docs)["metadata"]["name"] == fullname
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == values["nameOverride"] or "polyrl-operator"
    sa = values["serviceAccount"]
    assert account == spec["serviceAccountName"] == (sa["name"] or fullname)
    accounts = find(docs, "ServiceAccount")
    if sa["create"]:
        assert [a["metadata"]["name"] for a in accounts] == [account]
        assert accounts[0]["metadata"].get("annotations", {}) == sa["annotations"]
    else:
        assert accounts == []
    deployment = operator_deployment(docs)["spec"]
    assert deployment["replicas"] == values["replicas"]
    assert deployment["strategy"]["type"] == (
        "RollingUpdate" if values["leaderElection"]["enabled"] else "Recreate"
    )
    assert spec["securityContext"] == values["podSecurityContext"]
    assert container["securityContext"] == values["securityContext"]
    # Aggregated roles for namespace users: read-only view; edit/admin manage RLJobs.
    aggregated = {
        r["metadata"]["name"]: r
        for r in find(docs, "ClusterRole")
        if any(k.startswith("rbac.authorization.k8s.io/aggregate-to-") for k in r["metadata"]["labels"])
    }
    if values["rbac"]["aggregateToDefaultRoles"]:
        view, edit = aggregated["polyrl-view"], aggregated["polyrl-edit"]
        assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
        assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
        assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
        assert {v for _, _, v in _rules(view)} == {"get", "list", "watch"}
        assert {"create", "update", "patch", "delete"} <= {v for _, r, v in _rules(edit) if r == "rljobs"}
        assert {r for _, r, _ in _rules(view) | _rules(edit)} == {"rljobs", "rljobs/status"}
    else:
        assert aggregated == {}


def test_settings_change_rolls_the_deployment(renderings: dict[str, list[dict[str, Any]]]) -> None:
    checksum = {
        name: operator_deployment(docs)["spec"]["template"]["metadata"]["annotations"]["checksum/settings"]
        for name, docs in renderings.items()
    }
    assert checksum["kueue-gpus"] != checksum["default"]
    assert checksum["scheduling"] == checksum["default"]


@needs_helm
def test_default_chart_is_the_kustomize_base() -> None:
    if kubectl_binary() is None:
        pytest.skip("KUSTOMIZE NOT AVAILABLE: kubectl not built (run hack/controlplane/prepare.sh)")
    chart = render_chart(CHART)
    base = kustomize(MANIFESTS / "base")
    assert _granted(chart) == _granted(base)
    chart_settings = settings_of(chart)
    base_settings = settings_of(base)
    # The chart names its namespace and release in the settings; the base reads POD_NAMESPACE.
    chart_np, base_np = chart_settings.pop("networkPolicy"), base_settings.pop("networkPolicy")
    assert chart_np.pop("operatorNamespace") == "polyrl-system"
    assert chart_settings["leaderElection"].pop("leaseNamespace") == "polyrl-system"
    assert chart_np.pop("extraIngress") == []
    assert base_np["operatorPodLabels"].items() <= chart_np.pop("operatorPodLabels").items()
    base_np.pop("operatorPodLabels")
    assert chart_np == base_np
    assert chart_settings == base_settings
    assert sorted(operator_container(chart)["args"]) == sorted(operator_container(base)["args"])
    for field in ("securityContext",):
        assert operator_container(chart)[field] == operator_container(base)[field]


@pytest.mark.parametrize("name", list(BAD_VALUES))
@needs_helm
def test_helm_refuses_bad_values(name: str) -> None:
    with pytest.raises(HelmError, match="values don't meet the specifications"):
        render_chart_text(CHART, BAD_VALUES[name])


@needs_helm
def test_notes_tell_what_was_installed_and_how_to_upgrade_the_crd() -> None:
    notes = render_chart_text(CHART, OPTIONS["namespaced"], notes=True).split("NOTES:", 1)[1]
    assert "It watches RLJobs in: team-a, team-b." in notes
    assert "kubectl -n polyrl-system rollout status deployment/polyrl-operator" in notes
    assert "kubectl apply --server-side -f charts/polyrl/crds/" in notes
    assert "Kueue admission: off" in notes
    kueue = render_chart_text(CHART, OPTIONS["kueue-gpus"], notes=True)
    assert "Kueue admission: on" in kueue


@pytest.mark.controlplane
@pytest.mark.parametrize(
    "name", ["default", "namespaced", "kueue-gpus", "servicemonitor", "namespaced-kueue"]
)
def test_rendering_applies_and_the_examples_apply_after_it(
    controlplane: ControlPlane, renderings: dict[str, list[dict[str, Any]]], name: str
) -> None:
    cp = controlplane
    # What `helm install` does: crds/ first, then the templates.
    result = cp.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
    assert result.returncode == 0, result.stderr
    docs = renderings[name]
    if find(docs, "ServiceMonitor"):
        crd = REPO / "tests" / "data" / "monitoring" / "monitoring.coreos.com_servicemonitors.yaml"
        assert cp.kubectl("apply", "--server-side", "-f", str(crd)).returncode == 0
    cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    created = ["polyrl-system"] if cp.request("GET", "/api/v1/namespaces/polyrl-system")[0] == 404 else []
    created += [
        ns
        for ns in OPTIONS[name].get("watchNamespaces", [])
        if cp.request("GET", f"/api/v1/namespaces/{ns}")[0] == 404
    ]
    for ns in created:
        cp.create_namespace(ns)
    text = render_chart_text(CHART, OPTIONS[name])
    try:
        assert_apply_is_idempotent(cp, text)
        assert_examples_apply(cp, EXAMPLES, "t-chart")
    finally:
        cp.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=text, timeout=120)
        for ns in created:
            cp.delete_namespace(ns)


# ---- the genuine helm: lint, install, upgrade, uninstall ------------------------------------------


@needs_helm
def test_helm_lint_strict_passes() -> None:
    out = helm("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in out


@needs_helm
def test_helm_lint_strict_refuses_bad_values(tmp_path: Path) -> None:
    with pytest.raises(HelmError, match="/leaderElection/enabled': value must be true"):
        helm(
            "lint",
            "--strict",
            str(CHART),
            *release_args(tmp_path, BAD_VALUES["replicas-without-leader-election"]),
        )


@pytest.mark.controlplane
@needs_helm
def test_helm_installs_upgrades_and_uninstalls(controlplane: ControlPlane, tmp_path: Path) -> None:
    cp = controlplane
    suffix = uuid.uuid4().hex[:6]
    namespace, release = f"t-helm-{suffix}", f"t{suffix}"
    cp.create_namespace(namespace)
    deployment = f"/apis/apps/v1/namespaces/{namespace}/deployments/{release}-operator"
    cluster_role = f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{release}-operator"
    edit_role = f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{release}-edit"
    lease_role = (
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles/{release}-operator-leader-election"
    )

    def run(*args: str) -> str:
        return helm(*args, "--namespace", namespace, kubeconfig=cp.kubeconfig)

    def status() -> dict[str, Any]:
        out: dict[str, Any] = json.loads(run("status", release, "--output", "json"))
        return out

    try:
        run("install", release, str(CHART))
        assert (status()["info"]["status"], status()["version"]) == ("deployed", 1)
        code, live = cp.request("GET", deployment)
        assert code == 200, live
        assert live["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
        assert live["spec"]["replicas"] == 1
        assert (
            cp.request("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/rljobs.polyrl.dev")[0]
            == 200
        )
        for path in (cluster_role, edit_role, lease_role):
            assert cp.request("GET", path)[0] == 200, path

        upgrade = {
            "kueue": {"enabled": True},
            "replicas": 2,
            "rbac": {"scope": "cluster", "aggregateToDefaultRoles": False},
        }
        run("upgrade", release, str(CHART), *release_args(tmp_path, upgrade))
        assert (status()["info"]["status"], status()["version"]) == ("deployed", 2)
        assert cp.request("GET", deployment)[1]["spec"]["replicas"] == 2
        rules = cp.request("GET", cluster_role)[1]["rules"]
        assert any("workloads" in rule["resources"] for rule in rules)
        assert cp.request("GET", edit_role)[0] == 404  # helm removed what the new values leave out

        bad = BAD_VALUES["replicas-without-leader-election"]
        with pytest.raises(HelmError, match="values don't meet the specifications"):
            run("upgrade", release, str(CHART), *release_args(tmp_path, bad))
        assert (status()["info"]["status"], status()["version"]) == ("deployed", 2)

        run("uninstall", release)
        for path in (deployment, cluster_role, lease_role):
            assert cp.request("GET", path)[0] == 404, path
        with pytest.raises(HelmError, match="not found"):
            status()
        # helm never deletes a chart's CRD (nor so the users' RLJobs).
        assert (
            cp.request("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/rljobs.polyrl.dev")[0]
            == 200
        )
    finally:
        with contextlib.suppress(HelmError):
            run("uninstall", release)
        cp.delete_namespace(namespace)
