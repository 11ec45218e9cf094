{{/* The operator: its names and its RBAC rules. */}}

{{/* The operator's pods. */}}
{{- define "specsplit.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specsplit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "specsplit.operator.fullname" -}}
{{- printf "%s-operator" (include "specsplit.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specsplit.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "specsplit.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator's RBAC rules, mirroring operator/rbac.py (RULES) rule for rule; tests/charts compares them.
Takes (dict "clusterwide" BOOL): namespaced, the cluster-scoped parts go to the discovery ClusterRole.
*/}}
{{- define "specsplit.operator.rules" -}}
# kopf watches the resource, patches its metadata (finalizer, bookkeeping annotations) and its status.
- apiGroups: ["specsplit.dev"]
  resources: ["speculativedeployments"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["specsplit.dev"]
  resources: ["speculativedeployments/status"]
  verbs: ["patch"]
# Where the OwnerReferencesPermissionEnforcement admission plugin checks blockOwnerDeletion.
- apiGroups: ["specsplit.dev"]
  resources: ["speculativedeployments/finalizers"]
  verbs: ["update"]
# The owned objects: create-or-patch and cleanup; Deployments are also watched.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "create", "patch", "delete"]
# Pod IPs and metrics ports, to scrape the services' metrics and the coordinators' canary statistics.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
# Decisions and problems become Events on the resource.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .clusterwide }}
# kopf discovers the resources it serves.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
# Peering: replicas of the operator see each other and only one works.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings", "kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- else }}
# Peering: replicas of the operator see each other and only one works.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}
