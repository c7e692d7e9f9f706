{{/* The chart's name, or nameOverride. */}}
{{- define "mixrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name of the release's objects: fullnameOverride, else the release name when it already
says the chart's name, else <release>-<name>. */}}
{{- define "mixrl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "mixrl.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Selector labels are immutable on a Deployment: the name label stays mixrl-operator (not the
runs' app.kubernetes.io/name=mixrl) unless nameOverride says otherwise. */}}
{{- define "mixrl.selectorLabels" -}}
app.kubernetes.io/name: {{ .Values.nameOverride | default "mixrl-operator" | trunc 63 | trimSuffix "-" }}
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
{{- /* Not the namespace's `default` account: every pod using it would get the operator's rights. */ -}}
{{- required "serviceAccount.name: with serviceAccount.create false, name the existing account the operator runs as" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* <repository>@<digest> when a digest is set (it names the image itself; a tag can be pushed
again), else <repository>:<tag>, the tag defaulting to the chart's appVersion (never latest: the
schema refuses it). Called with (dict "root" $ "image" .Values.someImage). */}}
{{- define "mixrl.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The watched namespaces, checked: a namespaced operator needs at least one, and each must exist
unless the chart creates it. Existence is asked of the cluster only when it answers (not in
`helm template`), and not for the release's own namespace (`--create-namespace` makes it after
rendering). */}}
{{- define "mixrl.watchedNamespaces" -}}
{{- if not .Values.watch.allNamespaces -}}
{{- if empty .Values.watch.namespaces -}}
{{- fail "watch.namespaces: the operator is namespaced by default; list the namespaces it may run RLRuns in (--set 'watch.namespaces={rl}'), or set watch.allNamespaces=true for a cluster-wide operator (a ClusterRole)" -}}
{{- end -}}
{{- if and (not .Values.watch.createNamespaces) (lookup "v1" "Namespace" "" "default") -}}
{{- range .Values.watch.namespaces -}}
{{- if and (ne . $.Release.Namespace) (not (lookup "v1" "Namespace" "" .)) -}}
{{- fail (printf "watch.namespaces: namespace %q does not exist; create it first, or set watch.createNamespaces=true to let the chart create it" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- join "," .Values.watch.namespaces -}}
{{- end -}}

{{/* The operator's RBAC rules (generated from mixrl/operator/kube/rbac.py into files/rbac/): what every
operator needs, plus the rules of each feature the values turn on. Called with
(dict "root" $ "scope" "clusterwide"|"namespaced"). */}}
{{- define "mixrl.rules" -}}
{{- $v := .root.Values -}}
{{ .root.Files.Get "files/rbac/base.yaml" }}
{{- if ne $v.autoscaling.keda "off" }}
{{ .root.Files.Get "files/rbac/keda.yaml" }}
{{- end }}
{{- if ne $v.monitoring.mode "annotations" }}
{{ .root.Files.Get "files/rbac/podmonitors.yaml" }}
{{- else }}
{{- /* The operator deletes the per-run PodMonitors an earlier mode left: get and delete only. */}}
{{ .root.Files.Get "files/rbac/podmonitors-cleanup.yaml" }}
{{- end }}
{{- if $v.autoscaling.builtin }}
{{ .root.Files.Get "files/rbac/autoscaler.yaml" }}
{{- end }}
{{- if $v.peering.create }}
{{ .root.Files.Get (printf "files/rbac/peering-%s.yaml" .scope) }}
{{- end }}
{{- end -}}

{{/* Whether the policy values restrict anything (then the admission policy is worth installing). */}}
{{- define "mixrl.policyRestricts" -}}
{{- $p := .Values.policy -}}
{{- if or $p.allowedImages (not $p.allowEngineArgs) $p.allowedEngineFlags (not $p.allowScheduling) $p.allowedPriorityClasses -}}
true
{{- end -}}
{{- end -}}
