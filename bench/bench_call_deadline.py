"""What the coordinator's hung-call guard (services/coordinator/replica_health.py) adds to one worker call on the
round's path: ReplicaHealth.call against awaiting the same call bare, and against the guard as it was before a late
call could be waited for (the call awaited under asyncio.timeout, no task). The worker is a stand-in whose answer
arrives one event-loop turn later, as a reply read off a socket does, so the difference is the guard's own cost.

    python bench/bench_call_deadline.py [--calls 20000] [--rounds 7]

Variants run interleaved, the order rotated each round; on a shared machine read the differences of one round.
"""

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from specsplit.services.coordinator.replica_health import ReplicaHealth, call_size  # noqa: E402


class Worker:
    name = "worker"

    async def verify(self, items):
        await asyncio.sleep(0)  # the answer comes a loop turn later
        return items


async def bare(health, worker, items):
    return await worker.verify(items)


async def guard_before(health, worker, items):
    """The guard before late calls could be waited for: the call under a timeout, cancelled when it fires."""
    deadlines = health.deadlines
    size = call_size(items)
    deadline = deadlines.deadline(worker.name, "verify", size)
    call_id = deadlines.started(worker.name, "verify", size)
    started = time.perf_counter()
    try:
        async with asyncio.timeout(deadline):
            result = await worker.verify(items)
    finally:
        deadlines.ended(worker.name, call_id)
    deadlines.observe(worker.name, "verify", size, time.perf_counter() - started)
    return result


async def guard_now(health, worker, items):
    return await health.call(worker, "verify", items)


VARIANTS = {"bare": bare, "guard_before": guard_before, "guard_now": guard_now}


async def measure(calls: int, rounds: int) -> dict[str, list[float]]:
    health, worker, items = ReplicaHealth(), Worker(), ["s"]
    per_call: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            call = VARIANTS[name]
            started = time.perf_counter()
            for _ in range(calls):
                await call(health, worker, items)
            per_call[name].append((time.perf_counter() - started) / calls * 1e6)
    return per_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--name", default="call_deadline_cpu")
    args = parser.parse_args()
    per_call = asyncio.run(measure(args.calls, args.rounds))
    bare_rounds = per_call["bare"]
    rows = [{"variant": name, "us_per_call_median": round(statistics.median(values), 2),
             "over_bare_us_median": round(statistics.median(v - b for v, b in zip(values, bare_rounds)), 2),
             "us_per_call_rounds": [round(v, 2) for v in values]} for name, values in per_call.items()]
    print_table(rows, ["variant", "us_per_call_median", "over_bare_us_median"])
    print(f"wrote {write_results(args.name, rows, {'calls': args.calls, 'rounds': args.rounds})}")


if __name__ == "__main__":
    main()
