"""Least-privilege RBAC of the operator, for the Helm chart to mirror in a ClusterRole (the operator runs
with --all-namespaces). Each rule names the calls that need it; the tests check that every API call the
operator makes against the emulated API is covered by these rules.
"""

from typing import Any

RULES: list[dict[str, Any]] = [
    # kopf watches the resource, patches its metadata (finalizer, bookkeeping annotations) and its status.
    {"apiGroups": ["specsplit.dev"], "resources": ["speculativedeployments"], "verbs": ["list", "watch", "patch"]},
    {"apiGroups": ["specsplit.dev"], "resources": ["speculativedeployments/status"], "verbs": ["patch"]},
    # Needed where the OwnerReferencesPermissionEnforcement admission plugin checks blockOwnerDeletion.
    {"apiGroups": ["specsplit.dev"], "resources": ["speculativedeployments/finalizers"], "verbs": ["update"]},
    # The owned objects: create-or-patch, cleanup; Deployments are also watched (replica counts are ours).
    {"apiGroups": ["apps"], "resources": ["deployments"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["services", "configmaps"], "verbs": ["get", "create", "patch", "delete"]},
    # Pod IPs and metrics ports, to scrape the services' metrics and the coordinators' canary statistics.
    # A list per scrape is enough; no watch (no pod cache is kept).
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    # Decisions and problems are posted as Events on the resource.
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # kopf discovers the resources it serves.
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
     "verbs": ["list", "watch"]},
    # Peering: replicas of the operator see each other and only one works (settings.py). Cluster-wide it is
    # the ClusterKopfPeering; KopfPeering serves the operator run with --namespace instead. Verbs as in
    # kopf's own RBAC example.
    {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings", "kopfpeerings"],
     "verbs": ["get", "list", "watch", "patch"]},
]


def cluster_role(name: str = "specsplit-operator") -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
            "rules": RULES}
