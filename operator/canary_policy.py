"""Canary policy: a pure function of the coordinators' /v1/canary statistics -> promote, roll back, step up or hold.

Each coordinator replica reports its own counts; they are merged first (counts add up; tokens/s means are
weighted by requests, their standard errors combined as for a weighted mean of independent estimates).
Then one test at the policy's confidence, two-sided:
  acceptanceRate:  a two-proportion z-test on accepted / drafted tokens of the two variants;
  tokensPerSecond: a z-test on the difference of means, each standard error taken from the reported 95% CI.
Significantly better -> promote; significantly worse -> roll back; otherwise -> step the weight up (more
traffic, more evidence) until maxWeight, then hold. Nothing is decided before both variants reach minRequests.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from statistics import NormalDist
from typing import Any

from specsplit.operator.spec import PromotionPolicy

Z95 = NormalDist().inv_cdf(0.975)

PROMOTE, ROLLBACK, STEP_UP, HOLD = "promote", "rollback", "step-up", "hold"


@dataclasses.dataclass(frozen=True)
class VariantStats:
    name: str
    requests: int
    drafted_tokens: int
    accepted_tokens: int
    tokens_per_second: float | None
    tokens_per_second_se: float | None  # standard error of the mean

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None


@dataclasses.dataclass(frozen=True)
class CanaryDecision:
    action: str  # PROMOTE | ROLLBACK | STEP_UP | HOLD
    weight: int  # the canary weight after the decision
    code: str  # short and stable: what kind of decision, for status and for not repeating events
    message: str  # the numbers behind it


def _standard_error(ci95: Any) -> float | None:
    if not isinstance(ci95, (list, tuple)) or len(ci95) != 2:
        return None
    low, high = (float(bound) for bound in ci95)
    return max(high - low, 0.0) / (2 * Z95)


def merge_reports(reports: Iterable[Mapping[str, Any]]) -> dict[str, VariantStats]:
    """Merge the /v1/canary reports of every coordinator pod into one VariantStats per variant name."""
    parts: dict[str, list[Mapping[str, Any]]] = {}
    for report in reports:
        variants = report.get("variants")
        for variant in variants if isinstance(variants, list) else []:
            if isinstance(variant, Mapping):
                parts.setdefault(str(variant.get("name")), []).append(variant)
    merged = {}
    for name, items in parts.items():
        requests = sum(int(item.get("requests") or 0) for item in items)
        with_speed = [item for item in items if item.get("tokens_per_second") is not None
                      and int(item.get("requests") or 0) > 0]
        speed = se = None
        weight_total = sum(int(item["requests"]) for item in with_speed)
        if weight_total:
            speed = sum(int(item["requests"]) * float(item["tokens_per_second"]) for item in with_speed) / weight_total
            errors = [_standard_error(item.get("tokens_per_second_ci95")) for item in with_speed]
            if all(error is not None for error in errors):
                se = math.sqrt(sum((int(item["requests"]) / weight_total * error) ** 2
                                   for item, error in zip(with_speed, errors, strict=True)))
        merged[name] = VariantStats(
            name=name,
            requests=requests,
            drafted_tokens=sum(int(item.get("drafted_tokens") or 0) for item in items),
            accepted_tokens=sum(int(item.get("accepted_tokens") or 0) for item in items),
            tokens_per_second=speed,
            tokens_per_second_se=se,
        )
    return merged


def _acceptance_z(stable: VariantStats, canary: VariantStats) -> tuple[float, str] | None:
    if not stable.drafted_tokens or not canary.drafted_tokens:
        return None
    p_s, p_c = stable.acceptance_rate, canary.acceptance_rate
    assert p_s is not None and p_c is not None
    pooled = (stable.accepted_tokens + canary.accepted_tokens) / (stable.drafted_tokens + canary.drafted_tokens)
    variance = pooled * (1 - pooled) * (1 / stable.drafted_tokens + 1 / canary.drafted_tokens)
    if variance <= 0:
        return (0.0 if p_c == p_s else math.copysign(math.inf, p_c - p_s)), f"acceptance {p_c:.3f} vs {p_s:.3f}"
    return (p_c - p_s) / math.sqrt(variance), f"acceptance rate canary {p_c:.3f} vs stable {p_s:.3f}"


def _speed_z(stable: VariantStats, canary: VariantStats) -> tuple[float, str] | None:
    if None in (stable.tokens_per_second, canary.tokens_per_second, stable.tokens_per_second_se,
                canary.tokens_per_second_se):
        return None
    difference = canary.tokens_per_second - stable.tokens_per_second  # type: ignore[operator]
    se = math.hypot(stable.tokens_per_second_se, canary.tokens_per_second_se)  # type: ignore[arg-type]
    z = difference / se if se > 0 else (0.0 if difference == 0 else math.copysign(math.inf, difference))
    return z, f"tokens/s canary {canary.tokens_per_second:.1f} vs stable {stable.tokens_per_second:.1f}"


def decide(stats: Mapping[str, VariantStats], weight: int, policy: PromotionPolicy,
           stable_name: str = "stable", canary_name: str = "canary") -> CanaryDecision:
    """Decide the next step of a canary rollout at the current weight."""
    stable, canary = stats.get(stable_name), stats.get(canary_name)
    seen = {name: (stats[name].requests if name in stats else 0) for name in (stable_name, canary_name)}
    if stable is None or canary is None or min(seen.values()) < policy.min_requests:
        return CanaryDecision(HOLD, weight, "WaitingForRequests",
                              f"requests stable={seen[stable_name]} canary={seen[canary_name]}, "
                              f"need {policy.min_requests} each")
    test = _acceptance_z(stable, canary) if policy.metric == "acceptanceRate" else _speed_z(stable, canary)
    if test is None:
        return CanaryDecision(HOLD, weight, "NoStatistics", f"the coordinators report no {policy.metric} yet")
    z, evidence = test
    critical = NormalDist().inv_cdf(1 - (1 - policy.confidence) / 2)
    detail = f"{evidence}, z={z:.2f}, critical {critical:.2f} at {policy.confidence:.0%} confidence"
    if z >= critical:
        return CanaryDecision(PROMOTE, 0, "CanaryBetter", f"canary is better: {detail}")
    if z <= -critical:
        return CanaryDecision(ROLLBACK, 0, "CanaryWorse", f"canary is worse: {detail}")
    if weight < policy.max_weight:
        new_weight = min(weight + policy.step_percent, policy.max_weight)
        return CanaryDecision(STEP_UP, new_weight, "Inconclusive",
                              f"no significant difference yet ({detail}); weight {weight}% -> {new_weight}%")
    return CanaryDecision(HOLD, weight, "InconclusiveAtMaxWeight",
                          f"no significant difference yet ({detail}); holding at maxWeight {weight}%")
