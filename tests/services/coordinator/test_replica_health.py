"""Hung replicas (services/coordinator/replica_health.py) with fake network clients: a late call fails as
UNAVAILABLE after its deadline, and a replica marked down is probed, even while the coordinator is idle, and
told to release the sequences that moved away before it is used again."""

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
        self.released = []

    async def _answer(self, value):
        while self.frozen:
            await asyncio.sleep(0.01)
        return value

    async def verify(self, items):
        return await self._answer(["ok"] * len(items))

    async def release(self, handles):
        self.released.extend(await self._answer(handles))

    async def describe(self):
        return await self._answer("info")


def health() -> ReplicaHealth:
    return ReplicaHealth(DeadlineSettings(floor_seconds=0.2, factor=10.0, warm_up_seconds=5.0), probe_interval=0.05)


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

    assert 0.15 < asyncio.run(main()) < 1.0


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
