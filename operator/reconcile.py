"""One reconcile pass: the operator's decisions + the spec -> objects applied, leftovers removed, status computed.

Used by every handler that changes anything (spec changes, resume, the autoscaling and canary timers), so
there is one path from a decision to the cluster. A pass over objects already in shape sends no writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from specsplit.operator import conditions, naming
from specsplit.operator.apply import Applied, apply, merge_patch
from specsplit.operator.kube_client import KIND_OF_MANIFEST, KubeClient
from specsplit.operator.manifests import build_objects
from specsplit.operator.spec import DeploymentSpec
from specsplit.operator.state import OperatorState

COMPONENTS = (naming.COORDINATOR, naming.TARGET, naming.DRAFT, naming.DRAFT_CANARY)
SEPARATE, COLOCATED = "Separate", "Colocated"  # status.coordinator.mode


@dataclasses.dataclass
class Outcome:
    applied: list[Applied]
    removed: list[str]
    overridden: list[tuple[str, int, int]]  # (Deployment, replicas someone else set, replicas put back)

    @property
    def writes(self) -> int:
        return sum(1 for item in self.applied if item.action != "unchanged") + len(self.removed)

    def deployments(self) -> dict[str, Mapping[str, Any]]:
        """Live Deployments by component."""
        return {item.live["metadata"]["labels"][naming.LABEL_COMPONENT]: item.live
                for item in self.applied if item.live.get("kind") == "Deployment"}


def owned_names(instance: str) -> list[tuple[str, str]]:
    """(kind, name) of everything a resource may own, for cleanup."""
    return [
        ("Deployment", naming.component_name(instance, naming.COORDINATOR)),
        ("Deployment", naming.component_name(instance, naming.TARGET)),
        ("Deployment", naming.component_name(instance, naming.DRAFT)),
        ("Deployment", naming.component_name(instance, naming.DRAFT_CANARY)),
        ("Service", naming.coordinator_service_name(instance)),
        ("Service", naming.component_name(instance, naming.TARGET)),
        ("Service", naming.component_name(instance, naming.DRAFT)),
        ("Service", naming.component_name(instance, naming.DRAFT_CANARY)),
        ("ConfigMap", naming.config_map_name(instance)),
    ]


async def remove_if_present(client: KubeClient, namespace: str, kind: str, name: str, owner_uid: str) -> bool:
    """Delete an object this resource owns. GET first: a pass over a clean cluster issues no DELETE at all,
    and an object of that name that someone else owns is left alone."""
    resource = KIND_OF_MANIFEST[kind]
    live = await client.get(resource, namespace, name)
    owners = [ref.get("uid") for ref in (live or {}).get("metadata", {}).get("ownerReferences") or []
              if ref.get("controller")]
    if live is None or owners != [owner_uid]:
        return False
    return await client.delete(resource, namespace, name)


async def reconcile(client: KubeClient, body: Mapping[str, Any], spec: DeploymentSpec, state: OperatorState,
                    now: float) -> Outcome:
    namespace, instance = body["metadata"]["namespace"], body["metadata"]["name"]
    state.follow_spec(spec, now)
    plan = state.plan(spec)
    applied = [await apply(client, namespace, manifest) for manifest in build_objects(body, spec, plan)]
    removed = []
    leftovers = []
    if plan.canary_model is None:
        # Applied above: the variants file without the canary. The kubelet delivers it to the coordinators
        # within a minute or so; requests still routed to the vanished canary meanwhile carry on without a
        # draft (the coordinator's failure mode for a lost draft replica), and none is lost.
        name = naming.component_name(instance, naming.DRAFT_CANARY)
        leftovers += [("Deployment", name), ("Service", name)]
    if spec.coordinator.colocated:
        # Applied above: the public Service now leads to the target pods, which run the coordinator themselves.
        leftovers.append(("Deployment", naming.component_name(instance, naming.COORDINATOR)))
    for kind, name in leftovers:
        if await remove_if_present(client, namespace, kind, name, body["metadata"]["uid"]):
            removed.append(f"{kind} {name}")
    overridden = [(item.live["metadata"]["name"], item.replicas_overridden, item.live["spec"]["replicas"])
                  for item in applied if item.replicas_overridden is not None]
    return Outcome(applied=applied, removed=removed, overridden=overridden)


def _deployment_conditions(deployments: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    not_ready, rolling, failing = [], [], []
    for component in COMPONENTS:
        live = deployments.get(component)
        if live is None:
            continue
        wanted = live.get("spec", {}).get("replicas", 0)
        status = live.get("status") or {}
        ready = status.get("readyReplicas") or 0
        if ready < wanted:
            not_ready.append(f"{component} {ready}/{wanted}")
        if (status.get("observedGeneration") or 0) < (live.get("metadata", {}).get("generation") or 0) \
                or (status.get("updatedReplicas") or 0) < wanted:
            rolling.append(component)
        for item in status.get("conditions") or []:
            if (item.get("type") == "Available" and item.get("status") == "False") or \
                    (item.get("type") == "ReplicaFailure" and item.get("status") == "True"):
                failing.append(f"{component}: {item.get('reason')}: {item.get('message', '')}".strip())
    return [
        conditions.condition(conditions.READY, not not_ready,
                             "AllReplicasReady" if not not_ready else "ReplicasNotReady",
                             "all pools ready" if not not_ready else "ready: " + ", ".join(not_ready)),
        conditions.condition(conditions.PROGRESSING, bool(rolling or not_ready),
                             "RollingOut" if rolling or not_ready else "Stable",
                             ("rolling out: " + ", ".join(rolling or [n.split()[0] for n in not_ready]))
                             if rolling or not_ready else "every pool runs its latest template"),
        conditions.condition(conditions.DEGRADED, bool(failing), "DeploymentFailing" if failing else "AsExpected",
                             "; ".join(failing) if failing else "no failures reported"),
        conditions.condition(conditions.INVALID_SPEC, False, "Valid", "the spec is valid"),
    ]


def healthy_status(current: Mapping[str, Any], spec: DeploymentSpec, state: OperatorState, outcome: Outcome,
                   generation: int | None, now: float) -> dict[str, Any]:
    """The whole status the operator wants after a successful pass."""
    status = state.status(spec)
    deployments = outcome.deployments()
    for role in naming.ROLES:
        live = deployments.get(role, {})
        status[role]["readyReplicas"] = (live.get("status") or {}).get("readyReplicas") or 0
    status[naming.COORDINATOR] = _coordinator_status(spec, deployments)
    status["observedGeneration"] = generation
    status["conditions"] = conditions.merge(current.get("conditions"), _deployment_conditions(deployments),
                                            generation, now)
    return status


def _coordinator_status(spec: DeploymentSpec, deployments: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Where the public API runs and how many replicas it has: co-located, the target pool's (autoscaled with it;
    spec.coordinator.replicas does not apply)."""
    colocated = spec.coordinator.colocated
    live = deployments.get(naming.TARGET if colocated else naming.COORDINATOR, {})
    return {"mode": COLOCATED if colocated else SEPARATE,
            "desiredReplicas": (live.get("spec") or {}).get("replicas") or 0,
            "readyReplicas": (live.get("status") or {}).get("readyReplicas") or 0}


def invalid_status(current: Mapping[str, Any], errors: list[str], generation: int | None,
                   now: float) -> dict[str, Any]:
    """Mark the spec invalid, keep what the status said about the running pools (they keep their last good spec)."""
    existing = {item.get("type"): item for item in current.get("conditions") or []}
    message = "; ".join(errors)
    wanted = [
        {key: existing[conditions.READY][key] for key in ("type", "status", "reason", "message")}
        if conditions.READY in existing else
        conditions.condition(conditions.READY, False, "InvalidSpec", "nothing is deployed: the spec is invalid"),
        conditions.condition(conditions.PROGRESSING, False, "InvalidSpec", "not rolling out an invalid spec"),
        {key: existing[conditions.DEGRADED][key] for key in ("type", "status", "reason", "message")}
        if conditions.DEGRADED in existing else
        conditions.condition(conditions.DEGRADED, False, "AsExpected", "no failures reported"),
        conditions.condition(conditions.INVALID_SPEC, True, "ValidationFailed", message),
    ]
    return {"observedGeneration": generation,
            "conditions": conditions.merge(current.get("conditions"), wanted, generation, now)}


def status_changes(current: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """A merge-patch for `.status` with only what differs (empty: no write). None in `wanted` means absent."""
    patch: dict[str, Any] = {}
    for key, value in wanted.items():
        before = current.get(key)
        if value is None:
            if before is not None:
                patch[key] = None
        elif isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif before != value:
            patch[key] = value
    return patch
