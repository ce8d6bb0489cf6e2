{{/*
Names and labels. The app.kubernetes.io/name label is nameOverride or "polyrl-operator"; objects
are named fullnameOverride, else "<release>-<nameOverride>", else "<release>-operator".
*/}}
{{- define "polyrl.name" -}}
{{- default "polyrl-operator" .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "polyrl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (default "operator" .Values.nameOverride) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The operator's ServiceAccount: the chart's, or one the admin manages (serviceAccount.create=false). */}}
{{- define "polyrl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "polyrl.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "polyrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "polyrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "polyrl.labels" -}}
{{ include "polyrl.selectorLabels" . }}
app.kubernetes.io/part-of: polyrl
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "polyrl.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
What the operator does in a namespace it watches (the same rules as manifests/base/clusterrole.yaml;
tests/manifests/test_install_lifecycle.py checks both against the requests the operator really sends).
*/}}
{{- define "polyrl.namespacedRules" -}}
- apiGroups: [polyrl.dev]
  resources: [rljobs]
  verbs: [list, watch, patch, delete]
- apiGroups: [polyrl.dev]
  resources: [rljobs/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [pods, services, configmaps, secrets, serviceaccounts]
  verbs: [list, watch, create, patch, delete]
{{- if .Values.networkPolicy.enabled }}
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, watch, create, patch, delete]
{{- end }}
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if .Values.kueue.enabled }}
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [list, watch, create, patch, delete]
{{- end }}
{{- end -}}

{{/* The operator settings file (operator/polyrl_operator/settings.py), from the values. */}}
{{- define "polyrl.settings" -}}
{{- $networkPolicy := dict "enabled" .Values.networkPolicy.enabled "operatorNamespace" .Release.Namespace "operatorPodLabels" (include "polyrl.selectorLabels" . | fromYaml) "extraIngress" .Values.networkPolicy.extraIngress -}}
{{- $leaderElection := dict "enabled" .Values.leaderElection.enabled "leaseName" (include "polyrl.fullname" .) "leaseNamespace" .Release.Namespace -}}
{{- $settings := dict "defaultImage" .Values.runtimeImage "kueue" (dict "enabled" .Values.kueue.enabled) "gpuTypes" .Values.gpuTypes "networkPolicy" $networkPolicy "leaderElection" $leaderElection -}}
{{- toYaml (mergeOverwrite $settings (deepCopy .Values.extraSettings)) -}}
{{- end -}}
