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
A worker pool's NetworkPolicy: its gRPC port answers only the coordinator of the same SpeculativeDeployment,
its metrics port only the metrics peers. Takes (dict "ctx" $ "component" NAME).
*/}}
{{- define "specsplit.networkPolicy.worker" -}}
{{- $ctx := .ctx }}
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
    - from:
        - podSelector:
            matchLabels:
              {{- include "specsplit.component.selectorLabels" (dict "ctx" $ctx "component" "coordinator") | nindent 14 }}
      ports:
        - port: 50051
          protocol: TCP
    - from:
        {{- include "specsplit.networkPolicy.metricsPeers" $ctx | nindent 8 }}
      ports:
        - port: 9090
          protocol: TCP
{{- end }}
