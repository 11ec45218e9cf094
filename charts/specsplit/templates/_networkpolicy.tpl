{{/* NetworkPolicies for the pods the operator makes (and labels) for the chart's SpeculativeDeployment. */}}

{{/*
Labels the operator puts on the pods of one component of the chart's SpeculativeDeployment
(operator/naming.py: selector()). Takes (dict "ctx" $ "component" NAME).
*/}}
{{- define "specsplit.component.selectorLabels" -}}
app.kubernetes.io/name: specsplit
app.kubernetes.io/instance: {{ include "specsplit.deployment.name" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Who may scrape a pod's metrics port: the operator (it scales on them) and, if enabled, monitoring. */}}
{{- define "specsplit.networkPolicy.metricsPeers" -}}
- podSelector:
    matchLabels:
      {{- include "specsplit.operator.selectorLabels" . | nindent 6 }}
{{- if or .Values.monitoring.podMonitor.enabled .Values.monitoring.serviceMonitor.enabled }}
- namespaceSelector:
    {{- toYaml .Values.networkPolicy.monitoringNamespaceSelector | nindent 4 }}
{{- end }}
{{- end }}

{{/*
The ingress rule of the public API (gRPC on `grpcPort`, the OpenAI HTTP API on 8000): open to every client unless
networkPolicy.clients narrows it. Takes (dict "ctx" $ "grpcPort" PORT).
*/}}
{{- define "specsplit.networkPolicy.publicApi" -}}
- ports:
    - port: {{ .grpcPort }}
      protocol: TCP
    {{- if .ctx.Values.coordinator.httpPort }}
    - port: 8000
      protocol: TCP
    {{- end }}
  {{- with .ctx.Values.networkPolicy.clients }}
  from:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
A worker pool's NetworkPolicy: its gRPC and round-channel ports answer only the coordinators of the same
SpeculativeDeployment (their own pods, or with coordinator.colocated the target pods), its metrics port only the
metrics peers. Co-located, the target pods answer the public API instead: no other pod calls their worker ports.
Takes (dict "ctx" $ "component" NAME).
*/}}
{{- define "specsplit.networkPolicy.worker" -}}
{{- $ctx := .ctx }}
{{- $colocated := $ctx.Values.coordinator.colocated }}
{{- $servesPublicApi := and $colocated (eq .component "target") }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "specsplit.deployment.name" $ctx }}-{{ .component }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "specsplit.labels" $ctx | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  podSelector:
    matchLabels:
      {{- include "specsplit.component.selectorLabels" . | nindent 6 }}
  policyTypes:
    - Ingress
  ingress:
    {{- if $servesPublicApi }}
    {{- include "specsplit.networkPolicy.publicApi" (dict "ctx" $ctx "grpcPort" 50050) | nindent 4 }}
    {{- else }}
    - from:
        - podSelector:
            matchLabels:
              {{- include "specsplit.component.selectorLabels" (dict "ctx" $ctx "component" ($colocated | ternary "target" "coordinator")) | nindent 14 }}
      ports:
        - port: 50051
          protocol: TCP
        - port: 50061
          protocol: TCP
    {{- end }}
    - from:
        {{- include "specsplit.networkPolicy.metricsPeers" $ctx | nindent 8 }}
      ports:
        - port: 9090
          protocol: TCP
        {{- if $servesPublicApi }}
        - port: 9091
          protocol: TCP
        {{- end }}
{{- end }}
