"""The kustomize base and overlays, rendered by the real kustomize (kubectl 1.36) and applied to the
control plane; the RLJob examples apply after each. What the renderings configure is checked
against the operator's own code (settings model, CLI, defaults), not against copies of it."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from polyrl_operator.cli import build_parser
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv import ControlPlane
from polyrl_testenv.bad_rljobs import EXAMPLES, REPO
from polyrl_testenv.helm import find_helm, render_chart
from polyrl_testenv.install import (
    CHART,
    MANIFESTS,
    OVERLAYS,
    assert_apply_is_idempotent,
    assert_examples_apply,
    find,
    kubectl_binary,
    kustomize,
    kustomize_text,
    one,
    operator_container,
    operator_deployment,
    operator_subject,
    settings_of,
)

if kubectl_binary() is None:
    pytest.skip(
        "KUSTOMIZE NOT AVAILABLE: kubectl 1.36 not built (run hack/controlplane/prepare.sh)",
        allow_module_level=True,
    )

RENDERINGS = {"base": MANIFESTS / "base", **{o: MANIFESTS / "overlays" / o for o in OVERLAYS}}
CRD_FILE = "polyrl.dev_rljobs.yaml"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: kustomize(path) for name, path in RENDERINGS.items()}


def test_the_crd_copies_are_identical_to_the_generated_crd() -> None:
    generated = (REPO / "crds" / CRD_FILE).read_bytes()
    for copy in (MANIFESTS / "base" / "crds" / CRD_FILE, REPO / "charts" / "polyrl" / "crds" / CRD_FILE):
        assert copy.read_bytes() == generated, f"{copy} differs from crds/{CRD_FILE}: copy it again"
    assert sorted(p.name for p in (REPO / "crds").glob("*.yaml")) == [CRD_FILE]


@pytest.mark.parametrize("name", list(RENDERINGS))
def test_settings_are_valid_operator_settings(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    settings = OperatorSettings.model_validate(settings_of(rendered[name]))  # extra keys are refused
    # The runtime image comes from one place: the code default, which every install repeats.
    assert settings.default_image == OperatorSettings().default_image
    assert settings.kueue.enabled == (name == "with-kueue")
    # Job NetworkPolicies admit the operator by labels its pods really carry.
    pod_labels = operator_deployment(rendered[name])["spec"]["template"]["metadata"]["labels"]
    assert settings.network_policy.operator_pod_labels.items() <= pod_labels.items()
    # ... in the namespace the operator runs in (POD_NAMESPACE from the downward API).
    env = {e["name"]: e for e in operator_container(rendered[name]).get("env") or []}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


@pytest.mark.parametrize("name", list(RENDERINGS))
def test_deployment_args_are_the_real_cli(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    container = operator_container(rendered[name])
    assert "command" not in container  # the image's ENTRYPOINT: polyrl operator
    args = build_parser().parse_args(["operator", *container["args"]])
    assert args.settings == "/etc/polyrl/settings.yaml"
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/polyrl")
    assert mount["readOnly"] is True
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.metrics_port == ports["metrics"]
    assert args.liveness == f"http://0.0.0.0:{ports['liveness']}/healthz"
    probe = container["livenessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/healthz", "liveness")
    if name == "namespaced":
        watched = [r for r in find(rendered[name], "Role") if r["metadata"]["name"] == "polyrl-operator"]
        assert args.namespace and set(args.namespace) == {r["metadata"]["namespace"] for r in watched}
        assert not find(rendered[name], "ClusterRole") and not find(rendered[name], "ClusterRoleBinding")
    else:
        assert args.all_namespaces and not args.namespace


@pytest.mark.parametrize("name", list(RENDERINGS))
def test_operator_pod_is_hardened(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    pod = operator_deployment(rendered[name])["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sec = operator_container(rendered[name])["securityContext"]
    assert sec == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert operator_container(rendered[name])["resources"]["limits"]["memory"]
    namespace, account = operator_subject(rendered[name])
    assert one(rendered[name], "ServiceAccount", account)["metadata"]["namespace"] == namespace
    ns = one(rendered[name], "Namespace", namespace)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_monitoring_overlay_scrapes_the_metrics_service(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["monitoring"]
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service", "polyrl-operator-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    pod_labels = operator_deployment(docs)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_with_kueue_maps_the_example_gpu_types(rendered: dict[str, list[dict[str, Any]]]) -> None:
    settings = OperatorSettings.model_validate(settings_of(rendered["with-kueue"]))
    example = yaml.safe_load((EXAMPLES / "debate-gpu.yaml").read_text())
    used = {
        role["gpuType"]
        for p in example["spec"]["policies"]
        for role in (p["rollout"], p["trainer"])
        if "gpuType" in role
    }
    assert used <= set(settings.gpu_types)
    for name, placement in settings.gpu_types.items():
        assert placement.node_selector, name


AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def _aggregated(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, str], list[Any]]]:
    """The ClusterRoles aggregated into the default roles: name -> (aggregation labels, rules)."""
    return {
        r["metadata"]["name"]: (
            {k: v for k, v in r["metadata"]["labels"].items() if k.startswith(AGGREGATE)},
            r["rules"],
        )
        for r in find(docs, "ClusterRole")
        if any(k.startswith(AGGREGATE) for k in r["metadata"].get("labels") or {})
    }


@pytest.mark.parametrize("name", list(RENDERINGS))
def test_view_and_edit_roles_aggregate_rljobs_except_in_the_namespaced_install(
    rendered: dict[str, list[dict[str, Any]]], name: str
) -> None:
    aggregated = _aggregated(rendered[name])
    if name == "namespaced":
        assert aggregated == {}
        return
    assert set(aggregated) == {"polyrl-view", "polyrl-edit"}
    view_labels, view_rules = aggregated["polyrl-view"]
    edit_labels, edit_rules = aggregated["polyrl-edit"]
    assert view_labels == {AGGREGATE + "view": "true"}
    assert edit_labels == {AGGREGATE + "edit": "true", AGGREGATE + "admin": "true"}
    verbs = {(r, v) for rule in view_rules for r in rule["resources"] for v in rule["verbs"]}
    assert verbs == {(r, v) for r in ("rljobs", "rljobs/status") for v in ("get", "list", "watch")}
    writes = {v for rule in edit_rules if "rljobs" in rule["resources"] for v in rule["verbs"]}
    assert {"create", "update", "patch", "delete"} <= writes
    assert all(rule["apiGroups"] == ["polyrl.dev"] for rule in view_rules + edit_rules)
    helm, why = find_helm()
    if helm is None:
        pytest.skip(f"HELM NOT AVAILABLE: {why}")
    # The same roles as the chart's default (release "polyrl"), so both installs grant users alike.
    assert aggregated == _aggregated(render_chart(CHART))


def test_overlays_differ_from_base_only_where_they_say(rendered: dict[str, list[dict[str, Any]]]) -> None:
    def index(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
        return {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for d in docs}

    base = index(rendered["base"])
    expected_changes = {
        "monitoring": {("ServiceMonitor",)},
        "with-kueue": {("ClusterRole",), ("ConfigMap",), ("Deployment",)},  # rules, settings (hashed name)
        "namespaced": {
            ("ClusterRole",),
            ("ClusterRoleBinding",),
            ("Role",),
            ("RoleBinding",),
            ("Deployment",),
        },
    }
    for overlay, kinds in expected_changes.items():
        other = index(rendered[overlay])
        changed = {(k[0],) for k in base.keys() ^ other.keys()}
        changed |= {(k[0],) for k in base.keys() & other.keys() if base[k] != other[k]}
        assert changed == kinds, overlay


@pytest.mark.controlplane
@pytest.mark.parametrize("name", list(RENDERINGS))
def test_each_rendering_applies_and_the_examples_apply_after_it(
    controlplane: ControlPlane, name: str
) -> None:
    cp = controlplane
    text = kustomize_text(RENDERINGS[name])
    docs = [d for d in yaml.safe_load_all(text) if d]
    extra = [REPO / "tests" / "data" / "monitoring" / "monitoring.coreos.com_servicemonitors.yaml"]
    for path in extra if find(docs, "ServiceMonitor") else []:
        result = cp.kubectl("apply", "--server-side", "-f", str(path))
        assert result.returncode == 0, result.stderr
        cp.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/servicemonitors.monitoring.coreos.com",
        )
    created: list[str] = []
    for role_ns in sorted({r["metadata"]["namespace"] for r in find(docs, "Role")}):
        if cp.request("GET", f"/api/v1/namespaces/{role_ns}")[0] == 404:
            cp.create_namespace(role_ns)  # the admin's namespaces exist before their Roles
            created.append(role_ns)
    # Exactly the documented command: kubectl apply --server-side -k <dir>.
    result = cp.kubectl(
        "apply", "--server-side", "--force-conflicts", "-k", str(RENDERINGS[name]), timeout=120
    )
    assert result.returncode == 0, result.stderr
    try:
        cp.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s", "crd/rljobs.polyrl.dev", check=True
        )
        for doc in docs:  # every object is served back by the API it belongs to
            meta = doc["metadata"]
            group = doc["apiVersion"].rpartition("/")[0]
            args = ["get", f"{doc['kind'].lower()}.{group}".rstrip("."), meta["name"]]
            if meta.get("namespace"):
                args += ["-n", meta["namespace"]]
            live = cp.kubectl_json(*args)
            assert (live["kind"], live["metadata"]["name"]) == (doc["kind"], meta["name"])
        # Applying the same rendering again changes nothing (GitOps).
        assert_apply_is_idempotent(cp, text)
        assert_examples_apply(cp, EXAMPLES, "t-examples")
    finally:
        keep = ("CustomResourceDefinition", "Namespace")
        rest = yaml.safe_dump_all([d for d in docs if d["kind"] not in keep])
        cp.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=rest, timeout=120)
        for role_ns in created:
            cp.delete_namespace(role_ns)


def test_argocd_cm_patch_is_a_valid_configmap_patch() -> None:
    patch = yaml.safe_load((MANIFESTS / "argocd" / "argocd-cm-patch.yaml").read_text())
    assert set(patch) == {"data"}
    assert list(patch["data"]) == ["resource.customizations.health.polyrl.dev_RLJob"]
