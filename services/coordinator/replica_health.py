"""Hung replicas: bounded worker calls, probes of replicas marked down, and the KV they hold for nobody.

A call that outlives its deadline (call_deadlines.py) and whose replica does not answer a Describe either fails as
UNAVAILABLE (a replica that answers is busy: the call is waited for, up to the busy bound), so the coordinator's
failover for dead replicas takes over: the replica is marked down, its target sequences are re-prefilled elsewhere, its draft
sequences go to another draft or decode target-only. The replica may only be frozen; while it is down the
coordinator remembers which of its sequences moved away, and when a probe finds it answering again it is first
told to release them (their KV would otherwise stay until the worker's lease expires), then brought back.
"""

import asyncio
import logging
import time

from specsplit.services.coordinator.call_deadlines import CallDeadlines, DeadlineSettings
from specsplit.services.errors import Unavailable

log = logging.getLogger(__name__)

# How long a late call's replica has to answer a Describe to count as busy rather than hung: its event loop answers
# in milliseconds while its compute thread works (workers switch the GIL every 0.5 ms); a frozen process never does.
ANSWER_SECONDS = 0.25


class ReplicaHealth:
    def __init__(self, settings: DeadlineSettings | None = None, probe_interval: float = 2.0):
        self.deadlines = CallDeadlines(settings or DeadlineSettings())
        self.probe_interval = probe_interval
        self._gone: dict[str, set[str]] = {}   # replica name -> handles it may still hold that moved away
        self._replicas: dict[str, object] = {}  # replica name -> its client, for those in _gone
        self._probing: set[str] = set()
        self._last_probe = 0.0

    async def call(self, client, method: str, items: list):
        """`client.<method>(items)` within the replica's deadline; a late call raises Unavailable unless the replica
        still answers (then it is waited for, up to the busy bound)."""
        if getattr(client, "in_process", False):  # its calls run in this process: no deadline could fire in time
            return await getattr(client, method)(items)
        size = call_size(items)
        deadline = self.deadlines.deadline(client.name, method, size)
        call_id = self.deadlines.started(client.name, method, size)
        started = time.perf_counter()
        task = asyncio.ensure_future(getattr(client, method)(items))
        try:
            result, in_time = await self._await_while_alive(client, task, deadline, method, size)
        finally:
            self.deadlines.ended(client.name, call_id)
            if not task.done():
                task.cancel()
        if in_time:  # a late call's time (a capture, a queue) is no measure of the usual one
            self.deadlines.observe(client.name, method, size, time.perf_counter() - started)
        return result

    async def _await_while_alive(self, client, task, deadline: float, method: str, size: int):
        """-> (the call's result, whether it came within its deadline)."""
        waited = 0.0
        while True:
            if await _done_within(task, deadline):
                return task.result(), waited == 0.0
            waited += deadline
            if waited >= self.deadlines.settings.busy_seconds or not await self._answers(client):
                raise Unavailable(f"{client.name} did not answer a {method} of {size} tokens within {waited:.1f} s "
                                  f"(usually {self.deadlines.expected(client.name, method, size):.3f} s)")
            if waited == deadline:
                log.warning("%s is late with a %s of %d tokens (%.1f s, usually %.3f s) but answers: busy, waiting "
                            "up to %.0f s", client.name, method, size, waited,
                            self.deadlines.expected(client.name, method, size), self.deadlines.settings.busy_seconds)

    async def _answers(self, client) -> bool:
        """Whether the replica answers a Describe in time (a frozen process does not)."""
        if not hasattr(client, "describe"):
            return False
        try:
            async with asyncio.timeout(min(ANSWER_SECONDS, self.deadlines.settings.floor_seconds)):
                await client.describe()
            return True
        except Exception:  # noqa: BLE001 - late, refused or broken: not answering
            return False

    def moved_away(self, replica, handles) -> None:
        """These sequences left `replica` while it was not answering: it must release them when it is back."""
        if replica is not None:
            self._gone.setdefault(replica.name, set()).update(handles)
            self._replicas[replica.name] = replica

    def moved_away_handles(self) -> dict:
        """{replica client: handles it may still hold} for every replica with sequences that moved away."""
        return {self._replicas[name]: sorted(handles) for name, handles in self._gone.items() if handles}

    def gone_count(self, replica_name: str) -> int:
        return len(self._gone.get(replica_name, ()))

    def probe_down(self, pools) -> None:
        """Every probe interval, ask each replica marked down to describe itself (one probe at a time each)."""
        now = time.monotonic()
        if now - self._last_probe < self.probe_interval:
            return
        self._last_probe = now
        for pool in pools:
            for replica in pool.replicas:
                if replica.name in pool.down and replica.name not in self._probing and hasattr(replica, "describe"):
                    self._probing.add(replica.name)
                    asyncio.get_running_loop().create_task(self._probe(pool, replica))

    async def idle_until(self, wake: asyncio.Event, pools) -> None:
        """Wait for work (`wake`); meanwhile keep probing replicas marked down, since one that answers again must be
        told which sequences moved away even when no request is running."""
        while any(pool.down for pool in pools):
            self.probe_down(pools)
            try:
                async with asyncio.timeout(self.probe_interval):
                    await wake.wait()
                return
            except TimeoutError:
                continue
        await wake.wait()

    async def _probe(self, pool, replica) -> None:
        try:
            async with asyncio.timeout(max(self.deadlines.settings.floor_seconds, 1.0)):
                await replica.describe()
            gone = sorted(self._gone.get(replica.name, ()))
            if gone:
                await self.call(replica, "release", gone)
        except Exception:
            return  # still down: the next probe asks again
        finally:
            self._probing.discard(replica.name)
        # Nothing is pinned to a replica while it is down, so no handle was added during the probe.
        self._gone.pop(replica.name, None)
        pool.down.discard(replica.name)
        log.warning("replica %s is back%s", replica.name, f"; released {len(gone)} sequences that moved away" if gone else "")


async def _done_within(task: asyncio.Future, seconds: float) -> bool:
    """Whether `task` ends within `seconds`; it runs on either way (a late call may still be waited for). A timer
    and a done callback on one future, lighter than asyncio.wait on the round's path: with the task, the guard
    costs 6.4 us a call more than awaiting the call under a timeout did (bench/bench_call_deadline.py)."""
    if task.done():
        return True
    waiter = asyncio.get_running_loop().create_future()

    def wake(_=None):
        if not waiter.done():
            waiter.set_result(None)

    timer = asyncio.get_running_loop().call_later(seconds, wake)
    task.add_done_callback(wake)
    try:
        await waiter
    finally:
        timer.cancel()
        task.remove_done_callback(wake)
    return task.done()


def call_size(items: list) -> int:
    """The tokens a worker call computes (at least one per item): what its duration grows with."""
    size = 0
    for item in items:
        tokens = getattr(item, "token_ids", None)
        if tokens is None:
            tokens = getattr(item, "delta", ())
        size += max(1, len(tokens) + getattr(item, "k", 0) + len(getattr(item, "draft_token_ids", ())))
    return size
