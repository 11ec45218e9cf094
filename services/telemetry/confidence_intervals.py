"""95% confidence intervals for comparing draft variants, without SciPy (the services do not depend on it).

- `wilson`: a proportion (accepted / drafted tokens). Tokens of one request are correlated, so with few requests
  the interval is optimistic; it is what the operator's two-proportion test assumes too.
- `t_interval`: a mean (per-request tokens/s) with Student's t.
- `newcombe_difference`: the difference of two proportions (Newcombe's hybrid score interval).
- `paired_t_difference`: the mean of per-prompt differences (the offline compare runs the same prompts twice).
"""

import math

Z95 = 1.959963984540054

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
_T95 = [
    12.706204736, 4.302652730, 3.182446305, 2.776445105, 2.570581836, 2.446911851, 2.364624252, 2.306004135,
    2.262157163, 2.228138852, 2.200985160, 2.178812830, 2.160368656, 2.144786688, 2.131449546, 2.119905299,
    2.109815578, 2.100922040, 2.093024054, 2.085963447, 2.079613845, 2.073873068, 2.068657610, 2.063898562,
    2.059538553, 2.055529439, 2.051830516, 2.048407142, 2.045229642, 2.042272456,
]


def t95(df: int) -> float:
    """Two-sided 95% quantile of Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError("need at least one degree of freedom")
    if df <= len(_T95):
        return _T95[df - 1]
    # Cornish-Fisher expansion around the normal quantile: error < 1e-5 beyond 30 degrees of freedom.
    z = Z95
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2) + (
        3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z
    ) / (384 * df**3)


def wilson(successes: int, trials: int) -> tuple[float, float] | None:
    """Wilson score interval of successes / trials; None without trials."""
    if trials <= 0:
        return None
    p = successes / trials
    z2 = Z95 * Z95
    center = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = Z95 * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    low = 0.0 if successes == 0 else max(0.0, center - half)  # exact at the ends, where rounding would leave 1e-18
    high = 1.0 if successes == trials else min(1.0, center + half)
    return low, high


def t_interval(n: int, mean: float, variance: float) -> tuple[float, float] | None:
    """Interval of a mean from n samples with the given (unbiased) sample variance; None below two samples."""
    if n < 2:
        return None
    half = t95(n - 1) * math.sqrt(max(variance, 0.0) / n)
    return mean - half, mean + half


def newcombe_difference(successes_a: int, trials_a: int, successes_b: int, trials_b: int) -> tuple[float, float] | None:
    """Interval of p_b - p_a from the two Wilson intervals (Newcombe 1998, method 10)."""
    a, b = wilson(successes_a, trials_a), wilson(successes_b, trials_b)
    if a is None or b is None:
        return None
    pa, pb = successes_a / trials_a, successes_b / trials_b
    low = (pb - pa) - math.sqrt((pb - b[0]) ** 2 + (a[1] - pa) ** 2)
    high = (pb - pa) + math.sqrt((b[1] - pb) ** 2 + (pa - a[0]) ** 2)
    return low, high


def paired_t_difference(a: list[float], b: list[float]) -> tuple[float, tuple[float, float] | None]:
    """Mean of b_i - a_i and its interval."""
    if len(a) != len(b):
        raise ValueError("paired samples must have the same length")
    differences = [y - x for x, y in zip(a, b)]
    stats = RunningMoments()
    for d in differences:
        stats.add(d)
    return stats.mean, stats.interval()


class RunningMoments:
    """Count, mean and variance of a stream of samples (Welford), in constant memory."""

    def __init__(self):
        self.n = 0
        self.mean = 0.0
        self._m2 = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self._m2 += delta * (x - self.mean)

    @property
    def variance(self) -> float:
        return self._m2 / (self.n - 1) if self.n > 1 else 0.0

    def interval(self) -> tuple[float, float] | None:
        return t_interval(self.n, self.mean, self.variance)
