"""Hung replicas: bounded worker calls, probes of replicas marked down, and the KV they hold for nobody.

A call that outlives its deadline (call_deadlines.py) fails as UNAVAILABLE, so the coordinator's failover for dead
replicas takes over: the replica is marked down, its target sequences are re-prefilled elsewhere, its draft
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


class ReplicaHealth:
    def __init__(self, settings: DeadlineSettings | None = None, probe_interval: float = 2.0):
        self.deadlines = CallDeadlines(settings or DeadlineSettings())
        self.probe_interval = probe_interval
        self._gone: dict[str, set[str]] = {}   # replica name -> handles it may still hold that moved away
        self._replicas: dict[str, object] = {}  # replica name -> its client, for those in _gone
        self._probing: set[str] = set()
        self._last_probe = 0.0

    async def call(self, client, method: str, items: list):
        """`client.<method>(items)` within the replica's deadline; a late call raises Unavailable."""
        if getattr(client, "in_process", False):  # its calls run in this process: no deadline could fire in time
            return await getattr(client, method)(items)
        size = call_size(items)
        deadline = self.deadlines.deadline(client.name, method, size)
        call_id = self.deadlines.started(client.name, method, size)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(deadline):
                result = await getattr(client, method)(items)
        except TimeoutError:
            raise Unavailable(f"{client.name} did not answer a {method} of {size} tokens within {deadline:.1f} s "
                              f"(usually {self.deadlines.expected(client.name, method, size):.3f} s)") from None
        finally:
            self.deadlines.ended(client.name, call_id)
        self.deadlines.observe(client.name, method, size, time.perf_counter() - started)
        return result

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


def call_size(items: list) -> int:
    """The tokens a worker call computes (at least one per item): what its duration grows with."""
    size = 0
    for item in items:
        tokens = getattr(item, "token_ids", None)
        if tokens is None:
            tokens = getattr(item, "delta", ())
        size += max(1, len(tokens) + getattr(item, "k", 0) + len(getattr(item, "draft_token_ids", ())))
    return size
