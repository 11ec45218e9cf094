"""The canary policy as a pure function of the coordinators' /v1/canary statistics."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from scipy import stats as scipy_stats

from specsplit.operator.canary_policy import HOLD, PROMOTE, ROLLBACK, STEP_UP, decide, merge_reports
from specsplit.operator.spec import PromotionPolicy

ACCEPTANCE = PromotionPolicy(metric="acceptanceRate", confidence=0.95, min_requests=100, step_percent=10,
                             max_weight=40, interval_seconds=60)
SPEED = PromotionPolicy(metric="tokensPerSecond", confidence=0.95, min_requests=100, step_percent=10,
                        max_weight=40, interval_seconds=60)


def report(*variants: tuple[str, int, int, int, float, float]) -> dict:
    """(name, requests, drafted, accepted, tokens/s, CI half-width) -> a /v1/canary body."""
    return {"variants": [
        {"name": name, "weight": 50, "requests": requests, "drafted_tokens": drafted, "accepted_tokens": accepted,
         "acceptance_rate": accepted / drafted, "tokens_per_second": speed,
         "tokens_per_second_ci95": [speed - half, speed + half]}
        for name, requests, drafted, accepted, speed, half in variants]}


def test_merging_adds_counts_and_combines_errors_of_the_means() -> None:
    merged = merge_reports([report(("stable", 100, 1000, 700, 40.0, 2.0), ("canary", 10, 100, 80, 30.0, 4.0)),
                            report(("stable", 300, 3000, 2000, 44.0, 1.0))])
    stable, canary = merged["stable"], merged["canary"]
    assert (stable.requests, stable.drafted_tokens, stable.accepted_tokens) == (400, 4000, 2700)
    assert stable.tokens_per_second == pytest.approx((100 * 40 + 300 * 44) / 400)
    z95 = scipy_stats.norm.ppf(0.975)
    expected_se = math.sqrt((0.25 * 2.0 / z95) ** 2 + (0.75 * 1.0 / z95) ** 2)
    assert stable.tokens_per_second_se == pytest.approx(expected_se)
    assert canary.acceptance_rate == pytest.approx(0.8)


def test_nothing_is_decided_before_min_requests() -> None:
    stats = merge_reports([report(("stable", 5000, 50000, 35000, 40, 1), ("canary", 99, 990, 990, 90, 1))])
    decision = decide(stats, 10, ACCEPTANCE)
    assert (decision.action, decision.weight, decision.code) == (HOLD, 10, "WaitingForRequests")
    assert decide(merge_reports([]), 10, ACCEPTANCE).code == "WaitingForRequests"


def test_acceptance_rate_uses_a_two_proportion_z_test() -> None:
    stats = merge_reports([report(("stable", 500, 10000, 7000, 40, 1), ("canary", 200, 4000, 2900, 40, 1))])
    decision = decide(stats, 10, ACCEPTANCE)
    # The same test computed independently: pooled two-proportion z, two-sided at 95%.
    pooled = (7000 + 2900) / 14000
    z = (2900 / 4000 - 0.7) / math.sqrt(pooled * (1 - pooled) * (1 / 10000 + 1 / 4000))
    assert abs(z) > scipy_stats.norm.ppf(0.975)
    assert decision.action == PROMOTE and f"z={z:.2f}" in decision.message and decision.weight == 0


def test_confidence_changes_the_verdict() -> None:
    # Canary 0.715 vs stable 0.700 on 4000/10000 drafted tokens: z ~ 1.78, significant at 90%, not at 95%.
    stats = merge_reports([report(("stable", 500, 10000, 7000, 40, 1), ("canary", 200, 4000, 2860, 40, 1))])
    assert decide(stats, 10, ACCEPTANCE).action == STEP_UP
    lenient = dataclasses.replace(ACCEPTANCE, confidence=0.90)
    assert decide(stats, 10, lenient).action == PROMOTE


def test_tokens_per_second_uses_the_reported_intervals() -> None:
    worse = merge_reports([report(("stable", 500, 1, 1, 41.0, 1.0), ("canary", 150, 1, 1, 37.0, 1.5))])
    decision = decide(worse, 20, SPEED)
    assert (decision.action, decision.weight, decision.code) == (ROLLBACK, 0, "CanaryWorse")
    overlapping = merge_reports([report(("stable", 500, 1, 1, 41.0, 1.0), ("canary", 150, 1, 1, 40.0, 2.0))])
    assert decide(overlapping, 20, SPEED).action == STEP_UP


def test_inconclusive_steps_up_to_max_weight_then_holds() -> None:
    stats = merge_reports([report(("stable", 500, 10000, 7000, 40, 1), ("canary", 200, 4000, 2800, 40, 1))])
    weights = [10]
    for _ in range(5):
        decision = decide(stats, weights[-1], ACCEPTANCE)
        weights.append(decision.weight)
    assert weights == [10, 20, 30, 40, 40, 40]
    assert decide(stats, 40, ACCEPTANCE).code == "InconclusiveAtMaxWeight"


def test_false_promotions_stay_near_the_significance_level() -> None:
    """Both variants drawn from the same acceptance rate: at 95% confidence, ~2.5% promote, ~2.5% roll back."""
    rng = random.Random(7)
    outcomes = {PROMOTE: 0, ROLLBACK: 0}
    trials = 600
    for _ in range(trials):
        stable_accepted = sum(rng.random() < 0.7 for _ in range(400))
        canary_accepted = sum(rng.random() < 0.7 for _ in range(400))
        stats = merge_reports([report(("stable", 100, 400, stable_accepted, 40, 1),
                                      ("canary", 100, 400, canary_accepted, 40, 1))])
        action = decide(stats, 10, ACCEPTANCE).action
        if action in outcomes:
            outcomes[action] += 1
    for count in outcomes.values():
        assert count / trials < 0.06
