"""Per-call deadlines from each replica's measured call times (services/coordinator/call_deadlines.py)."""

import pytest

from specsplit.services.coordinator.call_deadlines import CallDeadlines, DeadlineSettings


def deadlines(**settings) -> CallDeadlines:
    return CallDeadlines(DeadlineSettings(**{"floor_seconds": 0.5, "factor": 10.0, "warm_up_seconds": 30.0, **settings}))


def test_first_call_of_a_kind_gets_the_warm_up_allowance():
    d = deadlines()
    assert d.deadline("t1", "prefill", 300) == pytest.approx(30.0)
    d.observe("t1", "verify", 8, 0.02)
    assert d.deadline("t1", "prefill", 300) == pytest.approx(30.0)  # verify timings say nothing about prefills
    assert d.deadline("t2", "verify", 8) == pytest.approx(30.0)     # nor about another replica


def test_a_measured_call_gets_factor_times_its_time_above_the_floor():
    d = deadlines()
    d.observe("t1", "verify", 8, 0.2)
    assert d.deadline("t1", "verify", 8) == pytest.approx(2.0)
    d.observe("t1", "verify", 7, 0.01)  # same bucket (5-8 tokens): the estimate follows, the floor holds
    for _ in range(50):
        d.observe("t1", "verify", 8, 0.01)
    assert d.deadline("t1", "verify", 8) == pytest.approx(0.5)


def test_estimate_forgets_a_slow_first_call():
    d = deadlines(floor_seconds=0.0)
    d.observe("t1", "verify", 4, 5.0)  # lazy allocation on the first call
    for _ in range(30):
        d.observe("t1", "verify", 4, 0.1)
    assert d.deadline("t1", "verify", 4) < 1.1


def test_unseen_size_scales_up_from_the_nearest_measured_bucket():
    d = deadlines(floor_seconds=0.0)
    d.observe("t1", "prefill", 16, 0.1)
    assert d.deadline("t1", "prefill", 64) == pytest.approx(4.0)   # 4x the tokens: 4x the time allowed
    assert d.deadline("t1", "prefill", 4) == pytest.approx(1.0)    # smaller: never less than the measured bucket


def test_calls_queued_on_the_same_replica_extend_the_deadline():
    d = deadlines(floor_seconds=0.0)
    d.observe("t1", "prefill", 1024, 1.0)
    d.observe("t1", "verify", 8, 0.05)
    alone = d.deadline("t1", "verify", 8)
    call = d.started("t1", "prefill", 1024)  # a long prefill runs first on that worker's compute thread
    assert d.deadline("t1", "verify", 8) == pytest.approx(alone + 10.0)
    assert d.deadline("t2", "verify", 8) == pytest.approx(30.0)  # other replicas are not affected
    d.ended("t1", call)
    assert d.deadline("t1", "verify", 8) == pytest.approx(alone)
