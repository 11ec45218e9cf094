"""The intervals the canary comparison rests on, checked against SciPy and a published example."""

import random

import pytest
from scipy import stats

from specsplit.services.telemetry.confidence_intervals import (
    RunningMoments,
    newcombe_difference,
    paired_t_difference,
    t95,
    wilson,
)


@pytest.mark.parametrize("df", [1, 2, 5, 10, 29, 30, 31, 45, 100, 1000, 100000])
def test_t_quantile_matches_scipy(df):
    assert t95(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-5)


@pytest.mark.parametrize("k, n", [(0, 10), (3, 10), (10, 10), (290, 400), (1, 1000)])
def test_wilson_matches_scipy(k, n):
    expected = stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
    assert wilson(k, n) == pytest.approx((expected.low, expected.high), abs=1e-6)
    assert wilson(0, 0) is None
    assert wilson(0, n)[0] == 0.0 and wilson(n, n)[1] == 1.0  # a rate of exactly 0 or 1 lies inside its interval


def test_newcombe_difference_matches_the_published_example():
    # Newcombe (1998), Statistics in Medicine 17:873, table II example (56/70 vs 48/80): 0.0524 to 0.3339.
    low, high = newcombe_difference(48, 80, 56, 70)
    assert (low, high) == pytest.approx((0.0524, 0.3339), abs=1e-4)


def test_running_moments_and_paired_interval_match_scipy():
    rng = random.Random(3)
    a = [rng.gauss(40, 5) for _ in range(25)]
    b = [x + rng.gauss(2, 1.5) for x in a]
    moments = RunningMoments()
    for x in a:
        moments.add(x)
    assert moments.mean == pytest.approx(stats.tmean(a))
    assert moments.variance == pytest.approx(stats.tvar(a))
    ci = stats.ttest_1samp(a, 0).confidence_interval(0.95)
    assert moments.interval() == pytest.approx((ci.low, ci.high))
    mean, interval = paired_t_difference(a, b)
    paired = stats.ttest_rel(b, a).confidence_interval(0.95)
    assert interval == pytest.approx((paired.low, paired.high))
    assert mean == pytest.approx(sum(b) / len(b) - sum(a) / len(a))
    assert RunningMoments().interval() is None


def test_wilson_interval_covers_the_true_rate_about_95_percent_of_the_time():
    rng = random.Random(11)
    p, n, trials = 0.7, 200, 2000
    covered = 0
    for _ in range(trials):
        k = sum(rng.random() < p for _ in range(n))
        low, high = wilson(k, n)
        covered += low <= p <= high
    assert 0.93 <= covered / trials <= 0.97
