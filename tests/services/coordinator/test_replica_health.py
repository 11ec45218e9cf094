"""Hung replicas (services/coordinator/replica_health.py) with fake network clients: a late call fails as
UNAVAILABLE after its deadline when its replica does not answer a Describe either, a late call whose replica answers
(busy: a graph capture, calls queued ahead) is waited for up to the busy bound, and a replica marked down is probed,
even while the coordinator is idle, and told to release the sequences that moved away before it is used again."""

import asyncio

import pytest

from specsplit.services.coordinator.call_deadlines import DeadlineSettings
from specsplit.services.coordinator.replica_health import ReplicaHealth
from specsplit.services.coordinator.replica_pools import ReplicaPool
from specsplit.services.errors import Unavailable


class FakeReplica:
    def __init__(self, name):
        self.name = name
        self.frozen = False
        self.busy_seconds = 0.0
        self.released = []

    async def _answer(self, value):
        while self.frozen:
            await asyncio.sleep(0.01)
        return value

    async def verify(self, items):
        await asyncio.sleep(self.busy_seconds)  # its compute thread busy; its event loop still answers Describe
        return await self._answer(["ok"] * len(items))

    async def release(self, handles):
        self.released.extend(await self._answer(handles))

    async def describe(self):
        return await self._answer("info")


def health(busy_seconds: float = 30.0) -> ReplicaHealth:
    return ReplicaHealth(DeadlineSettings(floor_seconds=0.2, factor=10.0, warm_up_seconds=5.0,
                                          busy_seconds=busy_seconds), probe_interval=0.05)


def test_a_call_ten_times_slower_than_usual_fails_unavailable_within_the_floor():
    async def main():
        h, replica = health(), FakeReplica("t1")
        for _ in range(3):
            assert await h.call(replica, "verify", ["a", "b"]) == ["ok", "ok"]
        replica.frozen = True
        started = asyncio.get_running_loop().time()
        with pytest.raises(Unavailable, match="did not answer a verify"):
            await h.call(replica, "verify", ["a", "b"])
        return asyncio.get_running_loop().time() - started

    assert 0.15 < asyncio.run(main()) < 1.5  # the deadline (0.2 s), then a Describe unanswered within the floor (0.2 s)


def test_a_late_call_of_a_replica_that_still_answers_is_waited_for_and_not_counted_as_usual():
    async def main():
        h, replica = health(), FakeReplica("t1")
        for _ in range(3):
            await h.call(replica, "verify", ["a", "b"])
        usual = h.deadlines.expected("t1", "verify", 2)
        replica.busy_seconds = 0.7  # past the 0.2 s deadline three times over
        assert await h.call(replica, "verify", ["a", "b"]) == ["ok", "ok"]
        assert h.deadlines.expected("t1", "verify", 2) == usual

    asyncio.run(main())


def test_a_replica_that_answers_but_never_finishes_fails_after_the_busy_bound():
    async def main():
        h, replica = health(busy_seconds=0.8), FakeReplica("t1")
        await h.call(replica, "verify", ["a"])
        replica.busy_seconds = 60.0  # a stuck device: the worker's loop answers, its call never ends
        started = asyncio.get_running_loop().time()
        with pytest.raises(Unavailable, match="did not answer a verify"):
            await h.call(replica, "verify", ["a"])
        return asyncio.get_running_loop().time() - started

    assert 0.75 < asyncio.run(main()) < 3.0


def test_a_call_is_sent_before_the_callbacks_already_queued_run():
    """The round's call starts in the caller's task: its request goes out before the event loop runs what was queued
    ahead of it (the client streams woken by the last round's tokens), which then runs while the worker computes."""
    async def main():
        h, replica, order = health(), FakeReplica("t1"), []
        sent = replica.verify

        async def verify(items):
            order.append("sent")
            return await sent(items)

        replica.verify = verify
        for _ in range(3):
            asyncio.get_running_loop().call_soon(order.append, "stream write")
        assert await h.call(replica, "verify", ["a"]) == ["ok"]
        return order

    assert asyncio.run(main()) == ["sent"] + ["stream write"] * 3


def test_a_hung_call_cancelled_by_its_guard_leaves_its_caller_usable_and_other_cancels_stay_cancels():
    """The guard cancels the caller's own task: the caller gets UNAVAILABLE and may await again afterwards, while a
    cancellation from elsewhere (the coordinator closing) still ends the call as a cancellation."""
    async def main():
        h, replica = health(), FakeReplica("t1")
        await h.call(replica, "verify", ["a"])
        replica.frozen = True
        with pytest.raises(Unavailable):
            await h.call(replica, "verify", ["a"])
        await asyncio.sleep(0.01)  # not cancelled: the guard's cancellation was taken back
        assert asyncio.current_task().cancelling() == 0
        calling = asyncio.create_task(h.call(replica, "verify", ["a"]))
        await asyncio.sleep(0.05)
        calling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await calling

    asyncio.run(main())


def test_a_resumed_replica_releases_what_moved_away_before_it_rejoins_even_when_idle():
    async def main():
        h, replica = health(), FakeReplica("t1")
        pool = ReplicaPool("targets", [replica])
        pool.mark_down(replica)
        h.moved_away(replica, ["seq-1", "seq-2"])
        replica.frozen = True
        wake = asyncio.Event()
        idle = asyncio.create_task(h.idle_until(wake, [pool]))  # the coordinator has no request
        await asyncio.sleep(0.3)
        assert pool.down == {"t1"} and replica.released == []  # still frozen: stays down
        replica.frozen = False
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not pool.down:
                break
        assert pool.down == set() and sorted(replica.released) == ["seq-1", "seq-2"]
        assert h.gone_count("t1") == 0
        wake.set()
        await asyncio.wait_for(idle, 1.0)

    asyncio.run(main())


def test_the_preferred_replica_takes_every_sequence_while_it_is_live():
    """The co-located target (coordinator/colocated.py) is preferred; the others only take over when it is down."""
    from types import SimpleNamespace

    from specsplit.services.coordinator.replica_pools import ReplicaPool

    local, peer = SimpleNamespace(name="local"), SimpleNamespace(name="peer")
    pool = ReplicaPool("target", [local, peer], preferred="local")
    assert [pool.pick().name for _ in range(4)] == ["local"] * 4
    pool.mark_down(local)
    assert pool.pick() is peer
