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
        still answers (then it is waited for, up to the busy bound).

        The call runs in the caller's own task, not a task of its own: its request is written before the event loop
        turns, ahead of the callbacks already queued (the client streams woken by the last round's tokens, 32 of
        them at batch 32), which then run while the worker computes instead of in front of the round's send. The
        guard is a timer that, when the deadline passes, asks the replica to describe itself and cancels the caller
        only if it does not answer."""
        if getattr(client, "in_process", False):  # its calls run in this process: no deadline could fire in time
            return await getattr(client, method)(items)
        size = call_size(items)
        deadline = self.deadlines.deadline(client.name, method, size)
        call_id = self.deadlines.started(client.name, method, size)
        started = time.perf_counter()
        guard = _LateCallGuard(self, client, method, size, deadline)
        try:
            result = await getattr(client, method)(items)
        except BaseException:  # cancelled, or the client's own error for a cancelled call
            if guard.verdict is not None and asyncio.current_task().uncancel() == 0:  # the guard's, no one else's
                raise guard.verdict from None
            raise
        finally:
            guard.stop()
            self.deadlines.ended(client.name, call_id)
        if not guard.waited:  # a late call's time (a capture, a queue) is no measure of the usual one
            self.deadlines.observe(client.name, method, size, time.perf_counter() - started)
        return result

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


class _LateCallGuard:
    """The deadline of one call awaited in the caller's task: each time the deadline passes, the replica must answer
    a Describe (then it is busy and the call is waited for, up to the busy bound) or the caller's task is cancelled
    with `verdict` set, which ReplicaHealth.call raises as UNAVAILABLE. A timer and no task while the call is in
    time: what it costs a call is bench/bench_call_deadline.py's."""

    def __init__(self, health: ReplicaHealth, client, method: str, size: int, deadline: float):
        self.health, self.client, self.method, self.size, self.deadline = health, client, method, size, deadline
        self.caller = asyncio.current_task()
        self.waited = 0.0
        self.verdict: Unavailable | None = None
        self._check: asyncio.Task | None = None
        self._timer = asyncio.get_running_loop().call_later(deadline, self._late)

    def _late(self) -> None:
        self._timer = None
        self.waited += self.deadline
        self._check = asyncio.get_running_loop().create_task(self._busy_or_hung())

    async def _busy_or_hung(self) -> None:
        settings = self.health.deadlines.settings
        if self.waited < settings.busy_seconds and await self.health._answers(self.client):
            if self.waited == self.deadline:
                log.warning("%s is late with a %s of %d tokens (%.1f s, usually %.3f s) but answers: busy, waiting "
                            "up to %.0f s", self.client.name, self.method, self.size, self.waited,
                            self.health.deadlines.expected(self.client.name, self.method, self.size), settings.busy_seconds)
            self._timer = asyncio.get_running_loop().call_later(self.deadline, self._late)
            return
        self.verdict = Unavailable(
            f"{self.client.name} did not answer a {self.method} of {self.size} tokens within {self.waited:.1f} s "
            f"(usually {self.health.deadlines.expected(self.client.name, self.method, self.size):.3f} s)")
        self.caller.cancel()

    def stop(self) -> None:
        """The call ended (answered, failed or cancelled): no more deadlines, no check left running."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._check is not None and not self._check.done() and self._check is not asyncio.current_task():
            self._check.cancel()


def call_size(items: list) -> int:
    """The tokens a worker call computes (at least one per item): what its duration grows with."""
    size = 0
    for item in items:
        tokens = getattr(item, "token_ids", None)
        if tokens is None:
            tokens = getattr(item, "delta", ())
        size += max(1, len(tokens) + getattr(item, "k", 0) + len(getattr(item, "draft_token_ids", ())))
    return size
