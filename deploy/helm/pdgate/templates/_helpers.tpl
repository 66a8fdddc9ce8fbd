{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "pdgate.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped object name: the release name if it already says pdgate. */}}
{{- define "pdgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "pdgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pdgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: router
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "pdgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The namespace a namespaced router watches. */}}
{{- define "pdgate.watchNamespace" -}}
{{- default .Release.Namespace .Values.scope.namespace }}
{{- end }}

{{- define "pdgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* What the router may read and write: the same rules for a ClusterRole or a Role. */}}
{{- define "pdgate.rbacRules" -}}
- apiGroups: ["networking.serving.volcano.sh"]
  resources: ["modelroutes", "modelservers"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
