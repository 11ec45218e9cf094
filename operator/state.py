"""The operator's own decisions about one SpeculativeDeployment, and how they are kept in its status.

The spec says what the user wants; this says what the operator decided on top of it: the replica counts
it scaled to, the canary's weight and phase, and a draft model promoted from a canary. It lives in memory
while the operator runs and is written to `.status` (the operator's record), so a restarted operator —
or the next leader — picks up where the last one stopped.

Promotion is recorded in status, not written into the spec: the spec is the user's (often a GitOps tool's)
desired state, and an operator writing it would fight whatever keeps it in sync. The promoted model stands
while `spec.draft.model` is still the model it replaced; a new `spec.draft.model` from the user wins.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any

from specsplit.operator import naming
from specsplit.operator.conditions import parse_timestamp, timestamp
from specsplit.operator.manifests import RolloutPlan
from specsplit.operator.scaling_policy import ScalingHistory
from specsplit.operator.scraping import PodSample
from specsplit.operator.spec import DeploymentSpec

PROGRESSING, PROMOTED, ROLLED_BACK = "Progressing", "Promoted", "RolledBack"


@dataclasses.dataclass
class RoleState:
    desired_replicas: int | None = None
    history: ScalingHistory = ScalingHistory()
    last_scale_reason: str | None = None
    previous_samples: dict[str, PodSample] = dataclasses.field(default_factory=dict)  # for latency deltas


@dataclasses.dataclass
class CanaryState:
    model: str
    weight: int
    phase: str = PROGRESSING
    last_decision: str | None = None
    last_decision_code: str | None = None
    last_decision_message: str | None = None
    last_decision_time: float | None = None


@dataclasses.dataclass
class Promotion:
    model: str  # the canary model now run by the draft pool
    replaced_model: str  # spec.draft.model at the time; the promotion stands while the spec still says this
    time: float


@dataclasses.dataclass
class OperatorState:
    roles: dict[str, RoleState] = dataclasses.field(default_factory=lambda: {r: RoleState() for r in naming.ROLES})
    canary: CanaryState | None = None
    promotion: Promotion | None = None
    last_autoscale: float | None = None
    last_canary_evaluation: float | None = None
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    # The status as this process last wrote it: a handler may see a body older than its own last write,
    # and must not write the same values again because of that.
    written_status: dict[str, Any] = dataclasses.field(default_factory=dict)
    deleted: bool = False  # set by the deletion handler, so that a timer still running does not recreate objects
    # The resource's name and the status of the latest body a handler saw (kept for the metrics, which have no body).
    namespace: str = ""
    name: str = ""
    seen_status: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> OperatorState:
        """Rebuild the decisions a previous operator process recorded."""
        status = status or {}
        state = cls()
        for role in naming.ROLES:
            recorded = status.get(role) or {}
            desired = recorded.get("desiredReplicas")
            state.roles[role] = RoleState(
                desired_replicas=desired if isinstance(desired, int) else None,
                history=ScalingHistory(last_scale_time=parse_timestamp(recorded.get("lastScaleTime"))),
                last_scale_reason=recorded.get("lastScaleReason"),
            )
        draft = status.get(naming.DRAFT) or {}
        promoted = draft.get("promotion") or {}
        if promoted.get("model") and promoted.get("replacedModel"):
            state.promotion = Promotion(promoted["model"], promoted["replacedModel"],
                                        parse_timestamp(promoted.get("time")) or 0.0)
        canary = status.get("canary") or {}
        if canary.get("model"):
            state.canary = CanaryState(
                model=canary["model"],
                weight=int(canary.get("weight") or 0),
                phase=canary.get("phase") or PROGRESSING,
                last_decision=canary.get("lastDecision"),
                last_decision_code=canary.get("lastDecisionReason"),
                last_decision_message=canary.get("lastDecisionMessage"),
                last_decision_time=parse_timestamp(canary.get("lastDecisionTime")),
            )
        return state

    def draft_model(self, spec: DeploymentSpec) -> str:
        if self.promotion is not None and self.promotion.replaced_model == spec.draft.model:
            return self.promotion.model
        return spec.draft.model

    def follow_spec(self, spec: DeploymentSpec, now: float) -> None:
        """Start, restart or drop the canary rollout, and keep replicas in the spec's bounds."""
        for role, role_spec in ((naming.TARGET, spec.target), (naming.DRAFT, spec.draft)):
            current = self.roles[role]
            desired = current.desired_replicas if current.desired_replicas is not None else role_spec.replicas.min
            current.desired_replicas = min(max(desired, role_spec.replicas.min), role_spec.replicas.max)
        if spec.canary is None:
            self.canary = None
        elif self.canary is None or self.canary.model != spec.canary.model:
            already = spec.canary.model == self.draft_model(spec)
            self.canary = CanaryState(
                model=spec.canary.model,
                weight=0 if already else spec.canary.weight,
                phase=PROMOTED if already else PROGRESSING,
                last_decision="start" if not already else None,
                last_decision_code="Started" if not already else "AlreadyPromoted",
                last_decision_message=(f"canary rollout of {spec.canary.model} at {spec.canary.weight}%"
                                       if not already else f"{spec.canary.model} already runs in the draft pool"),
                last_decision_time=now,
            )

    def canary_active(self) -> bool:
        return self.canary is not None and self.canary.phase == PROGRESSING

    def plan(self, spec: DeploymentSpec) -> RolloutPlan:
        active = self.canary_active()
        return RolloutPlan(
            target_replicas=self.roles[naming.TARGET].desired_replicas or spec.target.replicas.min,
            draft_replicas=self.roles[naming.DRAFT].desired_replicas or spec.draft.replicas.min,
            draft_model=self.draft_model(spec),
            canary_model=self.canary.model if active and self.canary else None,
            canary_weight=self.canary.weight if active and self.canary else 0,
        )

    def status(self, spec: DeploymentSpec) -> dict[str, Any]:
        """The operator-owned part of `.status` (replicas observed in the cluster are added by the caller)."""
        result: dict[str, Any] = {}
        for role, role_spec in ((naming.TARGET, spec.target), (naming.DRAFT, spec.draft)):
            current = self.roles[role]
            entry: dict[str, Any] = {
                "desiredReplicas": current.desired_replicas,
                "model": role_spec.model if role == naming.TARGET else self.draft_model(spec),
            }
            if current.history.last_scale_time is not None:
                entry["lastScaleTime"] = timestamp(current.history.last_scale_time)
            if current.last_scale_reason:
                entry["lastScaleReason"] = current.last_scale_reason
            result[role] = entry
        if self.promotion is not None:
            result[naming.DRAFT]["promotion"] = {"model": self.promotion.model,
                                                 "replacedModel": self.promotion.replaced_model,
                                                 "time": timestamp(self.promotion.time)}
        if self.canary is not None:
            canary: dict[str, Any] = {"model": self.canary.model, "weight": self.canary.weight,
                                      "phase": self.canary.phase}
            if self.canary.last_decision:
                canary["lastDecision"] = self.canary.last_decision
            if self.canary.last_decision_code:
                canary["lastDecisionReason"] = self.canary.last_decision_code
            if self.canary.last_decision_message:
                canary["lastDecisionMessage"] = self.canary.last_decision_message
            if self.canary.last_decision_time is not None:
                canary["lastDecisionTime"] = timestamp(self.canary.last_decision_time)
            result["canary"] = canary
        else:
            result["canary"] = None  # merge-patch: remove a finished rollout's record once the spec drops it
        return result
