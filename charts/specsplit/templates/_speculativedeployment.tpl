{{/* The SpeculativeDeployment the chart renders: role blocks, GPUs, model cache, value checks. */}}

{{/*
GPUs of a role: values carry them the Kubernetes way (nvidia.com/gpu in resources), the
SpeculativeDeployment as a count (`resources.gpus`) that the operator puts into both requests and limits.
Takes (dict "resources" MAP "path" "target.resources"); returns the count as text.
*/}}
{{- define "specsplit.gpuCount" -}}
{{- $key := "nvidia.com/gpu" }}
{{- $resources := .resources | default dict }}
{{- $requests := $resources.requests | default dict }}
{{- $limits := $resources.limits | default dict }}
{{- $request := hasKey $requests $key | ternary (toString (index $requests $key)) "" }}
{{- $limit := hasKey $limits $key | ternary (toString (index $limits $key)) "" }}
{{- if and $request (not $limit) }}
{{- fail (printf "%s: nvidia.com/gpu must be set in limits (Kubernetes requires extended resources to be limited); requests has %s" .path $request) }}
{{- end }}
{{- if and $request (ne $request $limit) }}
{{- fail (printf "%s: nvidia.com/gpu requests (%s) must equal limits (%s)" .path $request $limit) }}
{{- end }}
{{- $limit | default "0" | int }}
{{- end }}

{{/* Resource quantities without the GPUs, as strings. Takes a map of quantities. */}}
{{- define "specsplit.quantities" -}}
{{- range $name, $quantity := omit . "nvidia.com/gpu" }}
{{ $name }}: {{ $quantity | toString | quote }}
{{- end }}
{{- end }}

{{/* The `resources` of a SpeculativeDeployment role. Takes (dict "resources" MAP "path" TEXT "gpus" BOOL). */}}
{{- define "specsplit.cr.resources" -}}
{{- $resources := .resources | default dict }}
{{- $requests := $resources.requests | default dict }}
{{- $limits := $resources.limits | default dict }}
{{- if .gpus }}
gpus: {{ include "specsplit.gpuCount" . }}
{{- end }}
{{- with omit $requests "nvidia.com/gpu" }}
requests:
  {{- include "specsplit.quantities" . | trim | nindent 2 }}
{{- end }}
{{- with omit $limits "nvidia.com/gpu" }}
limits:
  {{- include "specsplit.quantities" . | trim | nindent 2 }}
{{- end }}
{{- end }}

{{/*
A target or draft pool of the SpeculativeDeployment, from the value block of the same name.
Takes (dict "ctx" $ "role" "target"|"draft").
*/}}
{{- define "specsplit.cr.workerRole" -}}
{{- $values := index .ctx.Values .role }}
{{- $path := printf "%s.resources" .role }}
{{- if gt (int $values.replicas.min) (int $values.replicas.max) }}
{{- fail (printf "%s.replicas.min (%d) must not exceed %s.replicas.max (%d)" .role (int $values.replicas.min) .role (int $values.replicas.max)) }}
{{- end }}
{{- $gpus := include "specsplit.gpuCount" (dict "resources" $values.resources "path" $path) | int }}
{{- $tp := int $values.tensorParallelSize }}
{{- if and (gt $tp 1) (lt $gpus $tp) }}
{{- fail (printf "%s.tensorParallelSize (%d) needs one GPU per shard: set nvidia.com/gpu to at least %d in %s.resources.limits" .role $tp $tp .role) }}
{{- end }}
{{- if and (eq .role "draft") (gt $tp (int .ctx.Values.target.tensorParallelSize)) }}
{{- fail (printf "draft.tensorParallelSize (%d) must not exceed target.tensorParallelSize (%d): the draft is the small model" $tp (int .ctx.Values.target.tensorParallelSize)) }}
{{- end }}

{{- if eq ($values.proposer | default "model") "ngram" }}
{{- include "specsplit.cr.ngram" $values }}
{{- else }}
model: {{ $values.model | quote }}
{{- end }}
replicas:
  min: {{ int $values.replicas.min }}
  max: {{ int $values.replicas.max }}
tensorParallelSize: {{ $tp }}
{{- if and (eq .role "target") $values.decodeAhead (ne $values.decodeAhead "auto") }}
decodeAhead: {{ $values.decodeAhead | quote }}
{{- end }}
resources:
  {{- include "specsplit.cr.resources" (dict "resources" $values.resources "path" $path "gpus" (ne ($values.proposer | default "model") "ngram")) | trim | nindent 2 }}
{{- with $values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- range $index, $variable := $values.extraEnv }}
{{- if and (hasKey $variable "value") (hasKey $variable "valueFrom") }}
{{- fail (printf "%s.extraEnv[%d] (%s): set value or valueFrom, not both" $.role $index $variable.name) }}
{{- end }}
{{- end }}
{{- with $values.extraEnv }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.autoscaling }}
autoscaling:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The n-gram proposer of a draft or canary block: no model, its tail lengths. Takes the value block. */}}
{{- define "specsplit.cr.ngram" }}
proposer: ngram
ngram:
  max: {{ int .ngram.max }}
  min: {{ int .ngram.min }}
{{- if gt (int .ngram.min) (int .ngram.max) }}
{{- fail (printf "ngram.min (%d) must not exceed ngram.max (%d)" (int .ngram.min) (int .ngram.max)) }}
{{- end }}
{{- end }}

{{/* Claim of the shared model cache, if any: an existing one or the one the chart creates. */}}
{{- define "specsplit.modelCache.claimName" -}}
{{- if .Values.modelCache.existingClaim }}
{{- .Values.modelCache.existingClaim }}
{{- else if .Values.modelCache.persistent }}
{{- printf "%s-models" (include "specsplit.deployment.name" .) }}
{{- end }}
{{- end }}

{{/*
Secrets the SpeculativeDeployment names: an "enabled" switch needs its Secret's name, so a forgotten name fails
the install instead of running without TLS or tokens.
*/}}
{{- define "specsplit.requireSecretNames" -}}
{{- $missing := list }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- $missing = append $missing "tls.secretName (a kubernetes.io/tls Secret with ca.crt)" }}
{{- end }}
{{- if and .Values.coordinator.tls.enabled (not .Values.coordinator.tls.secretName) }}
{{- $missing = append $missing "coordinator.tls.secretName (a Secret with tls.crt and tls.key)" }}
{{- end }}
{{- if and .Values.coordinator.auth.enabled (not .Values.coordinator.auth.tokenSecretName) }}
{{- $missing = append $missing "coordinator.auth.tokenSecretName (a Secret with the key tokens)" }}
{{- end }}
{{- if $missing }}
{{- fail (printf "enabled without the Secret to use, set: %s" (join "; " $missing)) }}
{{- end }}
{{- end }}
