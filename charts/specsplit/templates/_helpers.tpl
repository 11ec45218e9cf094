{{/*
Shared helpers: names, labels, the pinned image, the security contexts every pod gets.
Helpers of one part live beside it: _operator.tpl, _networkpolicy.tpl, _speculativedeployment.tpl.
Role helpers take a dict: (dict "ctx" $ "role" "target").
*/}}

{{- define "specsplit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specsplit.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specsplit.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object the chart renders. */}}
{{- define "specsplit.labels" -}}
helm.sh/chart: {{ include "specsplit.chart" . }}
app.kubernetes.io/name: {{ include "specsplit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specsplit
{{- end }}

{{/* Image reference, pinned: the tag defaults to the chart's appVersion; a digest pins it further. */}}
{{- define "specsplit.image" -}}
{{- $tag := toString (default .Chart.AppVersion .Values.image.tag) }}
{{- if eq $tag "latest" }}
{{- fail "image.tag must pin a version: \"latest\" is not allowed" }}
{{- end }}
{{- if .Values.image.digest }}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* Pod security context of every pod: a fixed non-root uid (the image's), RuntimeDefault seccomp. */}}
{{- define "specsplit.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Container security context of every container. */}}
{{- define "specsplit.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
privileged: false
capabilities:
  drop:
    - ALL
{{- end }}

{{/* Standard OpenTelemetry variables, only when an OTLP endpoint is set. Takes (dict "ctx" $ "service" NAME). */}}
{{- define "specsplit.otelEnv" -}}
{{- with .ctx.Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ $.service | quote }}
{{- end }}
{{- end }}

{{/*
Name of the SpeculativeDeployment the chart renders, and of the pods the operator makes for it.
*/}}
{{- define "specsplit.deployment.name" -}}
{{- default (include "specsplit.fullname" .) .Values.speculativeDeployment.name | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/* The Secret with the workers' shared secret: the one named in values, or the one the chart generates. */}}
{{- define "specsplit.workerAuth.secretName" -}}
{{- .Values.workerAuth.secretName | default (printf "%s-worker-auth" (include "specsplit.deployment.name" .)) }}
{{- end }}
