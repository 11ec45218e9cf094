"""Percentiles and a run's summary from known timings: the numbers `specsplit bench` prints and writes."""

import math

import pytest

from specsplit.bench.load_generator import LoadRun
from specsplit.bench.percentiles import distribution, percentile
from specsplit.bench.request_record import RequestRecord
from specsplit.bench.summary import summarize


def test_percentiles_interpolate_between_ranks():
    values = [40.0, 10.0, 30.0, 20.0]  # sorted: 10 20 30 40
    assert percentile(values, 0) == 10.0 and percentile(values, 100) == 40.0
    assert percentile(values, 50) == 25.0  # rank 1.5: halfway between 20 and 30
    assert percentile(values, 90) == pytest.approx(37.0)  # rank 2.7
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None
    assert distribution(values) == {"mean": 25.0, "p50": 25.0, "p90": pytest.approx(37.0), "p99": pytest.approx(39.7)}
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def _record(ttft, itls, tokens, rounds=None, drafted=None, accepted=None):
    return RequestRecord(ok=True, prompt_tokens=10, output_tokens=tokens, ttft=ttft, latency=ttft + sum(itls),
                         itls=list(itls), rounds=rounds, drafted_tokens=drafted, accepted_tokens=accepted)


def test_summary_of_known_timings():
    run = LoadRun(request_rate=2.0, max_concurrency=4, duration=4.0, records=[
        # 5 tokens in 3 chunks: ttft 0.1 s, gaps 0.2 and 0.4 s, latency 0.7 s, tpot (0.7 - 0.1) / 4 = 0.15 s
        _record(0.1, [0.2, 0.4], 5, rounds=2, drafted=8, accepted=2),
        # 3 tokens in 3 chunks: ttft 0.3 s, gaps 0.1 and 0.1 s, latency 0.5 s, tpot 0.1 s
        _record(0.3, [0.1, 0.1], 3, rounds=2, drafted=4, accepted=0),
        RequestRecord(ok=False, error="HTTP 400: bad"),
    ])
    s = summarize(run)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, {"HTTP 400: bad": 1})
    assert s["request_rate"] == 2.0 and s["max_concurrency"] == 4 and s["duration_s"] == 4.0
    assert s["request_throughput"] == pytest.approx(0.5) and s["output_tokens_per_s"] == pytest.approx(2.0)
    assert s["total_input_tokens"] == 20 and s["total_tokens_per_s"] == pytest.approx(7.0)
    assert s["ttft_ms"] == {"mean": pytest.approx(200.0), "p50": pytest.approx(200.0), "p90": pytest.approx(280.0),
                            "p99": pytest.approx(298.0)}
    assert s["tpot_ms"]["mean"] == pytest.approx(125.0) and s["tpot_ms"]["p50"] == pytest.approx(125.0)
    assert s["itl_ms"]["mean"] == pytest.approx(200.0)  # gaps 100 100 200 400
    assert s["itl_ms"]["p50"] == pytest.approx(150.0) and s["itl_ms"]["p99"] == pytest.approx(394.0)
    assert s["e2el_ms"]["p50"] == pytest.approx(600.0)
    assert s["acceptance_rate"] == pytest.approx(2 / 12)
    assert s["tokens_per_round"] == pytest.approx((2 + 4) / 4)  # each round emits its accepted tokens + 1
    assert s["interrupted"] is None


def test_summary_without_speculation_reports_or_completions():
    empty = summarize(LoadRun(math.inf, None, duration=1.0, records=[], interrupted="gone"))
    assert empty["request_rate"] == "inf" and empty["completed"] == 0 and empty["ttft_ms"]["p50"] is None
    assert empty["acceptance_rate"] is None and empty["tokens_per_round"] is None and empty["interrupted"] == "gone"
    other_server = summarize(LoadRun(1.0, None, duration=1.0, records=[_record(0.1, [0.1], 2)]))
    assert other_server["acceptance_rate"] is None and other_server["tokens_per_round"] is None
