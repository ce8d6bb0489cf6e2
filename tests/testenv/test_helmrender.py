"""The Helm renderer of the tests (hack/helmrender) renders like ``helm template``.

A throwaway chart exercises what charts commonly use: named templates, include + nindent, toYaml,
tpl, required, fail, if/range/with, default, .Release/.Chart/.Template/.Capabilities, NOTES.txt,
values files, --set, values.schema.json. The expected texts follow Helm v3.21's source (pkg/engine,
pkg/releaseutil, pkg/chartutil); there is no helm binary here to compare against.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from polyrl_testenv.helm import HelmRenderError, find_helmrender, render_chart, render_chart_text

CHART_YAML = """\
apiVersion: v2
name: demo
description: Throwaway chart for the helmrender tests
version: 1.2.3
appVersion: "4.5.6"
"""

VALUES_YAML = """\
replicas: 1
image:
  repository: registry.example/polyrl
  tag: ""
labels:
  team: rl
  tier: backend
resources:
  limits:
    cpu: "2"
    memory: 4Gi
  requests:
    cpu: 500m
ports:
  - name: http
    port: 8080
  - name: metrics
    port: 9090
serviceAccount:
  create: true
  name: ""
greeting: "hello {{ .Release.Name }} in {{ .Release.Namespace }}"
monitoring:
  enabled: true
"""

HELPERS_TPL = """\
{{/* Names and labels shared by every manifest. */}}
{{- define "demo.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "demo.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- with .Values.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}
"""

DEPLOYMENT_YAML = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "demo.fullname" . }}
  namespace: {{ .Release.Namespace }}
  labels:
    {{- include "demo.labels" . | nindent 4 }}
spec:
  replicas: {{ .Values.replicas }}
  template:
    spec:
      {{- if .Values.serviceAccount.create }}
      serviceAccountName: {{ default (include "demo.fullname" .) .Values.serviceAccount.name }}
      {{- end }}
      containers:
        - name: main
          image: "{{ required "image.repository is required" .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"
          ports:
          {{- range .Values.ports }}
            - name: {{ .name }}
              containerPort: {{ .port }}
          {{- end }}
          resources:
            {{- toYaml .Values.resources | nindent 12 }}
"""

# Sorts after deployment.yaml by file name, but a ConfigMap goes before a Deployment (kind order).
SETTINGS_YAML = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "demo.fullname" . }}-settings
data:
  greeting: {{ tpl .Values.greeting . | quote }}
  chart: {{ .Chart.Name }}-{{ .Chart.Version }}
  appVersion: {{ .Chart.AppVersion | quote }}
  description: {{ .Chart.Description }}
  release: {{ .Release.Name }} {{ .Release.Namespace }} {{ .Release.IsInstall }} {{ .Release.IsUpgrade }} {{ .Release.Revision }}
  template: {{ .Template.Name }}
  missing: "[{{ .Values.nope }}]"
  ports: {{ toJson .Values.ports | squote }}
"""

# Renders to whitespace only (dropped) unless the API is announced with --api-versions.
MONITOR_YAML = """\
{{- if and .Values.monitoring.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") }}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "demo.fullname" . }}
{{- end }}
"""

GUARD_YAML = """\
{{- if gt (int .Values.replicas) 10 }}
{{- fail (printf "replicas must be at most 10, got %d" (int .Values.replicas)) }}
{{- end }}
"""

NOTES_TXT = """\
Installed {{ .Release.Name }} ({{ .Chart.Name }} {{ .Chart.AppVersion }}).
"""

EXPECTED_DEFAULT = """\
---
# Source: demo/templates/settings.yaml
apiVersion: v1
kind: ConfigMap
metadata:
  name: polyrl-demo-settings
data:
  greeting: "hello polyrl in polyrl-system"
  chart: demo-1.2.3
  appVersion: "4.5.6"
  description: Throwaway chart for the helmrender tests
  release: polyrl polyrl-system true false 1
  template: demo/templates/settings.yaml
  missing: "[]"
  ports: '[{"name":"http","port":8080},{"name":"metrics","port":9090}]'
---
# Source: demo/templates/deployment.yaml
apiVersion: apps/v1
kind: Deployment
metadata:
  name: polyrl-demo
  namespace: polyrl-system
  labels:
    app.kubernetes.io/name: demo
    app.kubernetes.io/instance: polyrl
    app.kubernetes.io/managed-by: Helm
    helm.sh/chart: demo-1.2.3
    team: rl
    tier: backend
spec:
  replicas: 1
  template:
    spec:
      serviceAccountName: polyrl-demo
      containers:
        - name: main
          image: "registry.example/polyrl:4.5.6"
          ports:
            - name: http
              containerPort: 8080
            - name: metrics
              containerPort: 9090
          resources:
            limits:
              cpu: "2"
              memory: 4Gi
            requests:
              cpu: 500m
"""


@pytest.fixture(scope="module")
def helmrender() -> Path:
    binary, reason = find_helmrender()
    if binary is None:
        pytest.skip(f"HELM RENDERER NOT AVAILABLE: {reason}")
    return binary


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory, helmrender: Path) -> Path:
    root = tmp_path_factory.mktemp("charts") / "demo"
    files = {
        "Chart.yaml": CHART_YAML,
        "values.yaml": VALUES_YAML,
        "templates/_helpers.tpl": HELPERS_TPL,
        "templates/deployment.yaml": DEPLOYMENT_YAML,
        "templates/settings.yaml": SETTINGS_YAML,
        "templates/servicemonitor.yaml": MONITOR_YAML,
        "templates/guard.yaml": GUARD_YAML,
        "templates/NOTES.txt": NOTES_TXT,
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def by_kind(docs: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    return {str(doc["kind"]): doc for doc in docs}


def test_default_render_is_exact(chart: Path) -> None:
    text = render_chart_text(chart)
    assert text == EXPECTED_DEFAULT
    assert "NOTES" not in text and "Installed" not in text
    assert "ServiceMonitor" not in text  # its template rendered to whitespace only: dropped


def test_notes_only_on_request(chart: Path) -> None:
    text = render_chart_text(chart, notes=True)
    assert text == EXPECTED_DEFAULT + "NOTES:\nInstalled polyrl (demo 4.5.6).\n"


def test_set_overrides_nested_values(chart: Path) -> None:
    docs = by_kind(
        render_chart(
            chart,
            sets={
                "image.tag": "v2",
                "resources.limits.cpu": "4",
                "replicas": "3",
                "serviceAccount.name": "sa",
            },
        )
    )
    spec = docs["Deployment"]["spec"]
    assert isinstance(spec, dict)
    assert spec["replicas"] == 3
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "sa"
    container = pod["containers"][0]
    assert container["image"] == "registry.example/polyrl:v2"
    # --set types integers; the untouched siblings of the nested key stay.
    assert container["resources"] == {"limits": {"cpu": 4, "memory": "4Gi"}, "requests": {"cpu": "500m"}}


def test_values_files_merge_in_order(chart: Path, tmp_path: Path) -> None:
    first = tmp_path / "first.yaml"
    first.write_text("replicas: 2\nlabels:\n  extra: x\nserviceAccount:\n  create: false\n")
    second = tmp_path / "second.yaml"
    second.write_text("replicas: 5\nlabels:\n  team: null\n")  # null removes a chart default
    docs = by_kind(render_chart(chart, values_files=[first, second], values={"image": {"tag": "dev"}}))
    deployment = docs["Deployment"]
    assert deployment["spec"]["replicas"] == 5  # type: ignore[index]
    assert deployment["metadata"]["labels"] == {  # type: ignore[index]
        "app.kubernetes.io/name": "demo",
        "app.kubernetes.io/instance": "polyrl",
        "app.kubernetes.io/managed-by": "Helm",
        "helm.sh/chart": "demo-1.2.3",
        "extra": "x",
        "tier": "backend",
    }
    pod = deployment["spec"]["template"]["spec"]  # type: ignore[index]
    assert "serviceAccountName" not in pod
    assert pod["containers"][0]["image"] == "registry.example/polyrl:dev"


def test_capabilities_api_versions(chart: Path) -> None:
    text = render_chart_text(chart, api_versions=["monitoring.coreos.com/v1"])
    # Unknown kinds go after the known ones.
    assert text == EXPECTED_DEFAULT + textwrap.dedent(
        """\
        ---
        # Source: demo/templates/servicemonitor.yaml
        apiVersion: monitoring.coreos.com/v1
        kind: ServiceMonitor
        metadata:
          name: polyrl-demo
        """
    )
    disabled = render_chart_text(
        chart, api_versions=["monitoring.coreos.com/v1"], sets={"monitoring.enabled": "false"}
    )
    assert disabled == EXPECTED_DEFAULT


def test_required_fails_with_its_message(chart: Path) -> None:
    with pytest.raises(HelmRenderError) as err:
        render_chart_text(chart, sets={"image.repository": ""})
    assert str(err.value) == (
        "execution error at (demo/templates/deployment.yaml:17:21): image.repository is required"
    )
    assert err.value.returncode == 1


def test_fail_stops_rendering(chart: Path) -> None:
    with pytest.raises(HelmRenderError) as err:
        render_chart(chart, sets={"replicas": "11"})
    assert (
        str(err.value)
        == "execution error at (demo/templates/guard.yaml:2:4): replicas must be at most 10, got 11"
    )


def test_template_errors_name_file_and_line(chart: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    (broken / "templates").mkdir(parents=True)
    (broken / "Chart.yaml").write_text("apiVersion: v2\nname: broken\nversion: 0.1.0\n")
    (broken / "templates" / "cm.yaml").write_text(
        "kind: ConfigMap\ndata:\n  x: {{ .Values.x | nosuchfunc }}\n"
    )
    with pytest.raises(HelmRenderError) as err:
        render_chart_text(broken)
    assert str(err.value) == 'parse error at (broken/templates/cm.yaml:3): function "nosuchfunc" not defined'


def test_values_schema_is_enforced(helmrender: Path, tmp_path: Path) -> None:
    strict = tmp_path / "strict"
    (strict / "templates").mkdir(parents=True)
    (strict / "Chart.yaml").write_text("apiVersion: v2\nname: strict\nversion: 0.1.0\n")
    (strict / "values.yaml").write_text("replicas: 1\n")
    (strict / "values.schema.json").write_text(
        '{"type": "object", "required": ["replicas"],'
        ' "properties": {"replicas": {"type": "integer", "minimum": 1}}}'
    )
    (strict / "templates" / "cm.yaml").write_text(
        "kind: ConfigMap\ndata:\n  n: {{ .Values.replicas | quote }}\n"
    )
    assert render_chart(strict, sets={"replicas": "2"}) == [{"kind": "ConfigMap", "data": {"n": "2"}}]
    with pytest.raises(HelmRenderError) as err:
        render_chart(strict, sets={"replicas": "1.5"})  # --set keeps non-integers as strings
    assert str(err.value) == (
        "values don't meet the specifications of the schema(s) in the following chart(s):\n"
        "strict:\n- at '/replicas': got string, want integer"
    )
    with pytest.raises(HelmRenderError, match="missing property 'replicas'"):
        render_chart(strict, sets={"replicas": "null"})  # null removes the default


def test_missing_binary_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("POLYRL_HELMRENDER", str(tmp_path / "nope"))
    binary, reason = find_helmrender()
    assert binary is None
    assert "nope" in reason
    with pytest.raises(HelmRenderError, match="HELM RENDERER NOT AVAILABLE"):
        render_chart_text(tmp_path)
