{{/* Chart name, truncated to the 63 characters DNS labels allow. */}}
{{- define "skred.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name prefix of every resource. Kept to 52 characters: StatefulSet pods add
"-NN" and the controller-revision-hash label adds 11 more to the 63 allowed.
*/}}
{{- define "skred.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "skred.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels shared by every resource. */}}
{{- define "skred.labels" -}}
helm.sh/chart: {{ include "skred.chart" . }}
app.kubernetes.io/name: {{ include "skred.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector of the Skred broker pods (component keeps them apart from the etcd pods). */}}
{{- define "skred.selectorLabels" -}}
app.kubernetes.io/name: {{ include "skred.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: broker
{{- end }}

{{/* Selector of the bundled etcd pods. */}}
{{- define "skred.etcd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "skred.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: etcd
{{- end }}

{{- define "skred.headlessName" -}}
{{- printf "%s-headless" (include "skred.fullname" .) }}
{{- end }}

{{- define "skred.etcd.fullname" -}}
{{- printf "%s-etcd" (include "skred.fullname" .) }}
{{- end }}

{{- define "skred.etcd.headlessName" -}}
{{- printf "%s-etcd-headless" (include "skred.fullname" .) }}
{{- end }}

{{- define "skred.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "skred.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "skred.secretName" -}}
{{- default (include "skred.fullname" .) .Values.auth.existingSecret }}
{{- end }}

{{- define "skred.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{/* etcd client endpoints: the bundled etcd's client Service, or etcd.endpoints. */}}
{{- define "skred.etcdEndpoints" -}}
{{- if .Values.etcd.enabled }}
{{- printf "%s.%s.svc.%s:2379" (include "skred.etcd.fullname" .) .Release.Namespace .Values.clustering.clusterDomain }}
{{- else }}
{{- required "etcd.endpoints is required when etcd.enabled is false (comma-separated host:port)" .Values.etcd.endpoints }}
{{- end }}
{{- end }}

{{- define "skred.etcdPrefix" -}}
{{- default (include "skred.fullname" .) .Values.clustering.etcdPrefix }}
{{- end }}

{{/*
The aliveness check used by the readiness probe: the image's health command
(`skredctl aliveness`, as its HEALTHCHECK), pointed at the configured management
port. Credentials come from the env (SKRED_MAIN_DEFAULT_USER/PASSWORD).
*/}}
{{- define "skred.alivenessCommand" -}}
- skredctl
- --url=http://127.0.0.1:{{ .Values.ports.management }}
- aliveness
{{- end }}
