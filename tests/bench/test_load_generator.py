"""The request driver with a client in this process that answers after a given delay: concurrency limits are
kept, arrivals follow the rate, and a server that goes away ends the run with what was measured. (The real
servers are driven in tests/e2e/test_bench_cli.py.)"""

import asyncio
import math

from specsplit.bench.load_generator import run_load
from specsplit.bench.request_record import RequestClock, RequestRecord, ServerGone
from specsplit.bench.workloads import BenchRequest


class DelayClient:
    """Answers each request after `delay` seconds in `pieces` pieces; the `fail_at`-th request finds the server gone."""

    def __init__(self, delay=0.01, pieces=3, fail_at=None):
        self.delay, self.pieces, self.fail_at = delay, pieces, fail_at
        self.sent = self.in_flight = self.most_in_flight = 0

    async def send(self, request):
        self.sent += 1
        if self.fail_at is not None and self.sent >= self.fail_at:
            raise ServerGone("connection refused")
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        record = RequestRecord(prompt_tokens=1, output_tokens=self.pieces)
        clock = RequestClock(record)
        for _ in range(self.pieces):
            await asyncio.sleep(self.delay / self.pieces)
            clock.output()
        self.in_flight -= 1
        record.ok = True
        return clock.finish()


REQUESTS = [BenchRequest("x", 3) for _ in range(12)]


def test_all_at_once_within_the_concurrency_limit():
    client = DelayClient()
    run = asyncio.run(run_load(client, REQUESTS, math.inf, max_concurrency=3, progress=False))
    assert len(run.records) == 12 and all(r.ok and len(r.itls) == 2 for r in run.records)
    assert client.most_in_flight == 3 and not run.interrupted and run.duration > 0
    unlimited = DelayClient(delay=0.2)
    asyncio.run(run_load(unlimited, REQUESTS, math.inf, progress=False))
    assert unlimited.most_in_flight == 12


def test_a_rate_spaces_the_arrivals():
    # At 1000 req/s the mean gap is 1 ms: twelve 200 ms requests overlap. At 4 req/s with seed 5 the three gaps
    # are 0.24, 0.34 and 0.40 s: 10 ms requests never overlap, and the run lasts the gaps' sum.
    fast, slow = DelayClient(delay=0.2), DelayClient(delay=0.01)
    asyncio.run(run_load(fast, REQUESTS, 1000.0, progress=False, seed=1))
    assert fast.most_in_flight > 4
    run = asyncio.run(run_load(slow, REQUESTS[:4], 4.0, progress=False, seed=5))
    assert slow.most_in_flight == 1 and run.duration > 0.95


def test_a_server_going_away_ends_the_run_with_what_was_measured():
    client = DelayClient(delay=0.01, fail_at=6)
    run = asyncio.run(run_load(client, REQUESTS, 200.0, progress=False, seed=0))
    assert run.interrupted == "connection refused"
    assert 1 <= len(run.records) <= 5 and all(r.ok for r in run.records)
    assert client.sent < len(REQUESTS)  # nothing more was sent once it was gone
