"""The autoscaling policy as a pure function: time is passed in, so windows and cooldowns are walked through."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from specsplit.operator.scaling_policy import ScalingHistory, ScalingPolicy, decide

POLICY = ScalingPolicy(min_replicas=1, max_replicas=10, targets={"verifyQueueDepth": 4.0, "kvUtilization": 0.8},
                       scale_down_window_seconds=60, scale_up_window_seconds=0, scale_down_cooldown_seconds=30,
                       max_step=3)
T0 = 1000.0


def test_scales_up_on_the_most_demanding_metric_within_the_step() -> None:
    decision, history = decide(2, {"verifyQueueDepth": 8.0, "kvUtilization": 0.4}, 2, ScalingHistory(), POLICY, T0)
    assert decision.replicas == 4 and "verifyQueueDepth=8" in decision.reason
    assert history.last_scale_time == T0
    decision, _ = decide(2, {"verifyQueueDepth": 40.0}, 2, ScalingHistory(), POLICY, T0)
    assert decision.replicas == 5 and "step limited to 3" in decision.reason


def test_small_deviations_are_tolerated() -> None:
    decision, history = decide(4, {"verifyQueueDepth": 4.3, "kvUtilization": 0.75}, 4, ScalingHistory(), POLICY, T0)
    assert decision.replicas == 4 and "is right" in decision.reason
    assert history.last_scale_time is None


def test_never_leaves_the_bounds() -> None:
    decision, _ = decide(9, {"verifyQueueDepth": 400.0}, 9, ScalingHistory(), POLICY, T0)
    assert decision.replicas == 10
    decision, _ = decide(2, {"verifyQueueDepth": 0.0, "kvUtilization": 0.0}, 2, ScalingHistory(), POLICY, T0)
    assert decision.replicas == 1
    decision, _ = decide(14, {"verifyQueueDepth": 4.0}, 14, ScalingHistory(), POLICY, T0)
    assert decision.replicas == 10 and "outside [1, 10]" in decision.reason  # bounds tightened in the spec


def test_scale_down_waits_for_the_stabilisation_window() -> None:
    history = ScalingHistory()
    decision, history = decide(6, {"verifyQueueDepth": 4.0}, 6, history, POLICY, T0)
    assert decision.replicas == 6
    for seconds in (10, 30, 60):  # load is gone, but 6 was right within the last 60 s
        decision, history = decide(6, {"verifyQueueDepth": 0.5}, 6, history, POLICY, T0 + seconds)
        assert decision.replicas == 6 and "stabilisation window" in decision.reason
    decision, history = decide(6, {"verifyQueueDepth": 0.5}, 6, history, POLICY, T0 + 61)
    assert decision.replicas == 3  # 6 has left the window; down by at most 3


def test_scale_down_waits_for_the_cooldown_after_any_scaling() -> None:
    history = ScalingHistory(last_scale_time=T0)
    decision, history = decide(6, {"verifyQueueDepth": 0.5}, 6, history, POLICY, T0 + 20)
    assert decision.replicas == 6 and "cooldown, 10s left" in decision.reason
    decision, history = decide(6, {"verifyQueueDepth": 0.5}, 6, history, POLICY, T0 + 31)
    assert decision.replicas == 3
    # Scaling up is not held by the cooldown: capacity is needed now.
    decision, _ = decide(3, {"verifyQueueDepth": 8.0}, 3, history, POLICY, T0 + 32)
    assert decision.replicas == 6


def test_scale_up_window_takes_the_smallest_recent_recommendation() -> None:
    policy = dataclasses.replace(POLICY, scale_up_window_seconds=20)
    history = ScalingHistory()
    decision, history = decide(2, {"verifyQueueDepth": 4.0}, 2, history, policy, T0)
    decision, history = decide(2, {"verifyQueueDepth": 12.0}, 2, history, policy, T0 + 10)
    assert decision.replicas == 2 and "scale-up window" in decision.reason  # a burst of 10 s is not enough
    decision, history = decide(2, {"verifyQueueDepth": 12.0}, 2, history, policy, T0 + 25)
    assert decision.replicas == 5


def test_no_metrics_or_partial_metrics_never_scale_down() -> None:
    decision, history = decide(5, {"verifyQueueDepth": None}, 0, ScalingHistory(), POLICY, T0)
    assert decision.replicas == 5 and "no metrics" in decision.reason and history == ScalingHistory()
    decision, _ = decide(5, {"verifyQueueDepth": 0.0}, 2, ScalingHistory(), POLICY, T0)
    assert decision.replicas == 5 and "only 2 of 5 pods reported" in decision.reason
    decision, _ = decide(5, {"verifyQueueDepth": 8.0}, 2, ScalingHistory(), POLICY, T0)
    assert decision.replicas == 8  # partial metrics may still call for more


def test_history_keeps_only_the_window() -> None:
    history = ScalingHistory(recommendations=tuple((T0 + i, 4) for i in range(100)))
    _, history = decide(4, {"verifyQueueDepth": 4.0}, 4, history, POLICY, T0 + 200)
    assert all(T0 + 200 - t <= 60 for t, _ in history.recommendations)


@given(current=st.integers(1, 10), queue=st.floats(0, 100), kv=st.floats(0, 1), reporting=st.integers(0, 10),
       since_scale=st.floats(0, 500))
def test_any_decision_stays_in_bounds_and_within_a_step(current: int, queue: float, kv: float, reporting: int,
                                                        since_scale: float) -> None:
    history = ScalingHistory(last_scale_time=T0 - since_scale)
    decision, _ = decide(current, {"verifyQueueDepth": queue, "kvUtilization": kv}, reporting, history, POLICY, T0)
    assert POLICY.min_replicas <= decision.replicas <= POLICY.max_replicas
    assert abs(decision.replicas - current) <= POLICY.max_step
    if decision.replicas < current:
        assert since_scale >= POLICY.scale_down_cooldown_seconds and reporting >= current
