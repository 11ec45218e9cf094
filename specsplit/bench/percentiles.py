"""Percentiles as benchmark harnesses report them (linear interpolation between the closest ranks, numpy's
default), and the mean / p50 / p90 / p99 summary of one latency."""

import math

SUMMARY_PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values`; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> dict:
    """{"mean", "p50", "p90", "p99"} of `values` (None each when empty)."""
    summary = {"mean": sum(values) / len(values) if values else None}
    for q in SUMMARY_PERCENTILES:
        summary[f"p{q}"] = percentile(values, q)
    return summary
