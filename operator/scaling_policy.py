"""Autoscaling policy: a pure function of (current replicas, observed metrics, history, policy, now).

It follows the Kubernetes HPA algorithm where it has one, so its behaviour is familiar:
  desired = ceil(current * observed / target), per metric, the largest wins; within 10% of target: no change;
  scale-up:   the smallest recommendation over the scale-up window (default 0 s: react at once);
  scale-down: the largest recommendation over the stabilisation window (default 300 s), so a short dip
              does not drop capacity that is needed again a minute later;
and adds what GPU pools need on top: a cooldown after any scaling before a scale-down (a new replica must
load its model and fill its KV cache before the metrics mean anything), a bounded step per decision, and
no scale-down on partial metrics (pods that report nothing yet are not idle, just starting).
Time is an argument, never read from a clock, so the tests can walk through windows without sleeping.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

TOLERANCE = 0.1  # as the HPA's default --horizontal-pod-autoscaler-tolerance


@dataclasses.dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int
    max_replicas: int
    targets: Mapping[str, float]  # metric name -> per-pod target value
    scale_down_window_seconds: float = 300.0
    scale_up_window_seconds: float = 0.0
    scale_down_cooldown_seconds: float = 120.0
    max_step: int = 2


@dataclasses.dataclass(frozen=True)
class ScalingHistory:
    """What the policy remembers between decisions: recent recommendations and when replicas last changed."""
    recommendations: tuple[tuple[float, int], ...] = ()  # (time, recommended replicas), oldest first
    last_scale_time: float | None = None


@dataclasses.dataclass(frozen=True)
class ScalingDecision:
    replicas: int
    reason: str

    def changes(self, current: int) -> bool:
        return self.replicas != current


def _metric_recommendation(current: int, observed: float, target: float) -> int:
    ratio = observed / target
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    return max(1, math.ceil(current * ratio))


def decide(current: int, observed: Mapping[str, float | None], pods_reporting: int, history: ScalingHistory,
           policy: ScalingPolicy, now: float) -> tuple[ScalingDecision, ScalingHistory]:
    """Decide the replica count of one pool; return the decision and the history to pass next time."""
    low, high = policy.min_replicas, policy.max_replicas
    if not low <= current <= high:
        bounded = min(max(current, low), high)
        return (ScalingDecision(bounded, f"{current} replicas is outside [{low}, {high}]; set to {bounded}"),
                dataclasses.replace(history, last_scale_time=now))

    usable = {name: value for name, value in observed.items() if name in policy.targets and value is not None}
    if not usable or pods_reporting == 0:
        return ScalingDecision(current, "no metrics from any pod; holding"), history

    per_metric = {name: _metric_recommendation(current, value, policy.targets[name]) for name, value in usable.items()}
    driver = max(per_metric, key=lambda name: per_metric[name])
    raw = per_metric[driver]
    recommendation = min(max(raw, low), high)
    evidence = f"{driver}={usable[driver]:.3g} (target {policy.targets[driver]:.3g})"
    if recommendation < current and pods_reporting < current:
        recommendation = current
        evidence += f"; only {pods_reporting} of {current} pods reported, not scaling down on partial metrics"

    horizon = max(policy.scale_down_window_seconds, policy.scale_up_window_seconds)
    kept = tuple((t, r) for t, r in history.recommendations if now - t <= horizon)
    recommendations = kept + ((now, recommendation),)
    history = dataclasses.replace(history, recommendations=recommendations)

    def within(window: float) -> list[int]:
        return [r for t, r in recommendations if now - t <= window]

    if recommendation > current:
        stabilized = max(current, min(within(policy.scale_up_window_seconds)))
    elif recommendation < current:
        stabilized = min(current, max(within(policy.scale_down_window_seconds)))
        if stabilized < current and history.last_scale_time is not None:
            since = now - history.last_scale_time
            if since < policy.scale_down_cooldown_seconds:
                left = policy.scale_down_cooldown_seconds - since
                return (ScalingDecision(current, f"{evidence} suggests {recommendation}; scale-down cooldown, "
                                                 f"{left:.0f}s left"), history)
    else:
        return ScalingDecision(current, f"{evidence}; {current} replicas is right"), history

    if stabilized == current:
        window = "scale-up" if recommendation > current else "stabilisation"
        return (ScalingDecision(current, f"{evidence} suggests {recommendation}; held by the {window} window"),
                history)
    step = max(-policy.max_step, min(policy.max_step, stabilized - current))
    replicas = current + step
    bounded = "" if replicas == stabilized else f" (step limited to {policy.max_step})"
    return (ScalingDecision(replicas, f"{evidence}: {current} -> {replicas}{bounded}"),
            dataclasses.replace(history, last_scale_time=now))
