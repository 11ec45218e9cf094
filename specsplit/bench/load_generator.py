"""The request driver every `specsplit bench` run shares: requests sent at a Poisson rate (or all at once), at most
`max_concurrency` in flight, each timed by its client; a warm-up first. A server that goes away ends the run: what
was measured until then is kept, and the run says why it ended."""

import asyncio
import math
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

from specsplit.bench.request_record import RequestRecord, ServerGone


@dataclass
class LoadRun:
    request_rate: float  # requests per second asked for (inf: all at once)
    max_concurrency: int | None
    duration: float = 0.0  # seconds from the first request sent to the last answer (or to the interruption)
    records: list[RequestRecord] = field(default_factory=list)
    interrupted: str = ""  # why the run ended early (the server went away), else ""


async def warm_up(client, requests: list) -> None:
    """Send each request once and forget the timings (first calls pay one-time costs on both ends)."""
    for request in requests:
        await client.send(request)


async def run_load(client, requests: list, request_rate: float = math.inf, max_concurrency: int | None = None,
                   seed: int = 0, progress: bool = True, label: str = "") -> LoadRun:
    from tqdm import tqdm

    run = LoadRun(request_rate, max_concurrency)
    arrivals = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else nullcontext()
    gone = asyncio.Event()
    bar = tqdm(total=len(requests), desc=label or None, disable=not progress, file=sys.stderr, unit="req")

    async def one(request) -> None:
        async with limit:
            if gone.is_set():
                return
            try:
                record = await client.send(request)
            except ServerGone as error:
                run.interrupted = run.interrupted or str(error)
                gone.set()
                return
            except (ValueError, KeyError, TypeError) as error:  # an answer this client cannot read
                record = RequestRecord(error=f"unreadable answer: {type(error).__name__}: {error}")
        run.records.append(record)
        bar.update(1)

    start = time.perf_counter()
    tasks = []
    stopped = asyncio.ensure_future(gone.wait())
    try:
        for index, request in enumerate(requests):
            if index and not math.isinf(request_rate):  # Poisson arrivals: exponential gaps, cut short if it goes
                await asyncio.wait([stopped], timeout=arrivals.expovariate(request_rate))
            if gone.is_set():
                break
            tasks.append(asyncio.ensure_future(one(request)))
        pending = set(tasks)
        while pending and not gone.is_set():
            _, pending = await asyncio.wait(pending | {stopped}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(stopped)
        run.duration = time.perf_counter() - start
    finally:
        for task in tasks:
            task.cancel()  # requests in flight when the server went away: not measured
        await asyncio.gather(*tasks, return_exceptions=True)
        stopped.cancel()
        bar.close()
    return run
