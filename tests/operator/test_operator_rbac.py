"""The operator's RBAC rules as the chart will install them (coverage of every call: see conftest's operator)."""

from __future__ import annotations

import kubernetes_validate

from specsplit.operator import rbac


def test_cluster_role_is_valid_and_narrow() -> None:
    role = rbac.cluster_role()
    kubernetes_validate.validate(role, "1.30.0", strict=True)
    granted = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert not any("*" in grant for grant in granted)
    assert not any(resource in ("secrets", "pods/exec", "clusterroles", "rolebindings")
                   for _, resource, _ in granted)
    assert ("", "pods", "list") in granted and ("", "pods", "create") not in granted
    assert ("apps", "deployments", "watch") in granted  # replica counts changed by others are seen
    assert ("specsplit.dev", "speculativedeployments/status", "patch") in granted
