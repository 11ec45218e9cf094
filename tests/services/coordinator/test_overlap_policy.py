"""The overlap decision: the stated bound, and `auto` turning overlap off where it cannot win."""

import pytest

from specsplit.services.coordinator.overlap_policy import (
    OverlapPolicy,
    expected_tokens,
    hit_rate,
    overlap_speedup_bound,
    overlapped_tokens,
    overlapped_round_time,
    serial_round_time,
)


def test_bound_formulas():
    assert serial_round_time(0.004, 0.010) == pytest.approx(0.014)
    # Every pre-proposal used: the draft is hidden entirely behind the verification.
    assert overlapped_round_time(0.005, 0.010, all_hit=1.0) == pytest.approx(0.010)
    # None used: a full draft call, then the concurrent phase.
    assert overlapped_round_time(0.005, 0.010, all_hit=0.0) == pytest.approx(0.015)
    # A measured phase replaces the ideal max.
    assert overlapped_round_time(0.005, 0.010, all_hit=0.0, phase=0.014) == pytest.approx(0.019)
    assert hit_rate(0.9, 4, 0.9) == pytest.approx(0.9 ** 5)
    assert expected_tokens(0.9, 4) == pytest.approx(sum(0.9 ** i for i in range(5)))
    # A sequence that catches up: in the long run a share g / (g + 1 - h) of its rounds verify proposals.
    h, share = 0.9 ** 5, 0.9 / (0.9 + 1 - 0.9 ** 5)
    assert overlapped_tokens(0.9, 4, 0.9) == pytest.approx(share * expected_tokens(0.9, 4) + 1 - share)
    assert overlapped_tokens(0.9, 4, 0.9, may_catch_up=False) == pytest.approx(expected_tokens(0.9, 4))
    # alpha = 0.9, k = 4, draft 4 steps of 1 ms (+1 for the guess, +2 catching up), verify 10 ms.
    bound = overlap_speedup_bound(0.9, 4, 0.9, 8, t_propose=0.004, t_ahead=0.005, t_verify=0.010)
    assert bound == pytest.approx((overlapped_tokens(0.9, 4, 0.9) / 0.010) / (expected_tokens(0.9, 4) / 0.014))
    assert bound > 1.05  # catching up, nothing waits for the draft at any batch size
    # Sequences that must propose first (seeded): a large batch almost never has every proposal made ahead right,
    # so overlap pays a draft call and the extra guess step.
    assert overlap_speedup_bound(0.7, 4, 0.7, 32, 0.004, 0.005, 0.010, may_catch_up=False) < 1.0
    # A draft slower than the verification: catching up cannot hide it.
    assert overlap_speedup_bound(0.9, 4, 0.9, 1, 0.020, 0.025, 0.010) < 1.0


def test_modes():
    assert OverlapPolicy("on").decide(1, 4, [0.1], None, None, concurrent=False)
    assert not OverlapPolicy("off").decide(1, 4, [0.99], 0.004, 0.01, concurrent=True)
    assert not OverlapPolicy("on").decide(1, 0, [0.9], 0.004, 0.01, concurrent=True)  # nothing to overlap
    with pytest.raises(ValueError):
        OverlapPolicy("sometimes")


def test_auto_needs_concurrent_workers_and_measured_costs():
    policy = OverlapPolicy("auto")
    assert not policy.decide(1, 4, [0.9], 0.004, 0.010, concurrent=False)  # in-process: never
    assert not policy.decide(1, 4, [0.9], None, 0.010, concurrent=True)    # serial costs not measured yet
    assert policy.decide(1, 4, [0.9], 0.004, 0.010, concurrent=True)       # the bound says it may pay: try


def test_auto_off_when_the_bound_says_no():
    policy = OverlapPolicy("auto")
    assert not policy.decide(1, 4, [0.9], 0.020, 0.010, concurrent=True)   # the draft is slower than verifying
    # Catching up yields fewer tokens a round (1.8 against 2.8 at alpha 0.7): a draft call 40% of a verification's
    # is not worth hiding at that price.
    assert not policy.decide(32, 4, [0.7] * 32, 0.004, 0.010, concurrent=True)
    # Seeded sequences propose first when they missed: a batch of them almost never skips that call.
    assert not policy.decide(8, 4, [0.9] * 8, 0.004, 0.010, concurrent=True, may_catch_up=[False] * 8)
    assert policy.decide(8, 4, [0.9] * 8, 0.004, 0.010, concurrent=True)  # the same batch, greedy: it pays


def test_auto_measures_the_phase_and_turns_off_on_a_shared_device():
    shared, separate = OverlapPolicy("auto"), OverlapPolicy("auto")
    for _ in range(3):
        shared.record_phase(1, 4, phase_seconds=0.015, ahead_seconds=0.005)     # verify + draft one after the other
        separate.record_phase(1, 4, phase_seconds=0.0102, ahead_seconds=0.005)  # truly concurrent
    assert not shared.decide(1, 4, [0.9], 0.004, 0.010, concurrent=True)
    assert separate.decide(1, 4, [0.9], 0.004, 0.010, concurrent=True)
    assert separate.last_estimate["measured"] < separate.last_estimate["serial"]


def test_guess_rate_is_measured():
    policy = OverlapPolicy("auto")
    assert policy.guess_rate(0.8) == pytest.approx(0.8)
    for matched in [False] * 40:
        policy.record_guess(matched)
    assert policy.guess_rate(0.8) < 0.1
    # A draft that never guesses the bonus: pre-proposals are never used, so overlap is not tried.
    assert not policy.decide(1, 4, [0.95], 0.004, 0.010, concurrent=True)


def test_refresh_tries_the_other_choice_once():
    policy = OverlapPolicy("auto", refresh_interval=10)
    for _ in range(3):
        policy.record_phase(1, 4, 0.0102, 0.005)
    choices = [policy.decide(1, 4, [0.9], 0.004, 0.010, concurrent=True) for _ in range(30)]
    assert choices.count(False) == 3 and choices.count(True) == 27


def test_a_slow_trial_is_retried_after_the_refresh_interval():
    policy = OverlapPolicy("auto", refresh_interval=10)
    policy.record_phase(1, 4, phase_seconds=0.030, ahead_seconds=0.030)  # one trial hit by a pause
    choices = [policy.decide(1, 4, [0.9], 0.004, 0.010, concurrent=True) for _ in range(20)]
    assert choices.count(True) == 2  # off, but overlapped once per interval to measure again
    for _ in range(5):
        policy.record_phase(1, 4, phase_seconds=0.0102, ahead_seconds=0.005)  # the pause is gone
    assert policy.decide(1, 4, [0.9], 0.004, 0.010, concurrent=True)


def test_costs_at_a_k_not_measured_come_from_the_measured_ones():
    """Near the batch's ends its round k shrinks (each request's room): the overlap decision then reads costs along
    the curves through the k measured (speculation_policy.along, as the speculation policy predicts them), rather
    than falling back to serial rounds until that k is measured (which a round of mixed k never does)."""
    from collections import deque

    from specsplit.services.coordinator.speculation_policy import BucketCosts

    costs = BucketCosts()
    assert costs.costs_near(3) == (None, None)
    costs.propose[4], costs.verify[4] = deque([0.004, 0.005]), deque([0.010])
    assert costs.costs_near(4) == (0.004, 0.010)
    assert costs.costs_near(3) == (pytest.approx(0.003), pytest.approx(0.010))  # fewer steps: in proportion
    costs.propose[1], costs.verify[1] = deque([0.0013]), deque([0.007])
    assert costs.costs_near(3) == (pytest.approx(0.0031), pytest.approx(0.009))  # between k = 1 and 4
    assert costs.costs_near(6) == (pytest.approx(0.0058), pytest.approx(0.012))  # beyond: the last slope
    costs.propose[2] = deque([0.002])  # a propose cost without its verification: not a measured k
    assert costs.costs_near(2) == (pytest.approx(0.0022), pytest.approx(0.008))
