{{/* Full name of the release's objects: the release name, unless it already says mixrl. */}}
{{- define "mixrl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "mixrl.selectorLabels" -}}
app.kubernetes.io/name: mixrl-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "mixrl.labels" -}}
{{ include "mixrl.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mixrl
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "mixrl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mixrl.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "mixrl.image" -}}
{{- printf "%s:%s" .repository (default $.appVersion .tag) -}}
{{- end -}}

{{/* The watched namespaces, checked: a namespaced operator needs at least one. */}}
{{- define "mixrl.watchedNamespaces" -}}
{{- if and (not .Values.watch.allNamespaces) (empty .Values.watch.namespaces) -}}
{{- fail "watch.namespaces: list at least one namespace, or set watch.allNamespaces to true" -}}
{{- end -}}
{{- join "," .Values.watch.namespaces -}}
{{- end -}}
