"""The draft-variants file applied live to the coordinator's pools: new variants join as their replicas answer,
weights change at once, removed variants and addresses get no new requests and close only once nothing is
pinned to them. Draft clients here are stand-ins that only record being closed (the e2e test connects real ones)."""

import asyncio
import json
import os
import random

import pytest

from specsplit.services.coordinator.draft_variants_file import DraftVariantsWatcher, parse_draft_variants
from specsplit.services.coordinator.replica_pools import ReplicaPool, pick_variant
from specsplit.services.errors import InvalidArgument


class StandInDraft:
    def __init__(self, address):
        self.name = address
        self.closed = False

    async def close(self):
        self.closed = True


class StandInCoordinator:
    def __init__(self):
        self.drafts: list[ReplicaPool] = []


def write(path, variants):
    # Like a ConfigMap update: a new file swapped in (new inode), not an edit in place.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"variants": variants}))
    os.replace(tmp, path)


@pytest.fixture
def setup(tmp_path):
    path = tmp_path / "variants.json"
    coordinator = StandInCoordinator()
    connected, unreachable = [], set()

    async def connect(address):
        await asyncio.sleep(0)
        if address in unreachable:
            raise ConnectionError(f"{address} is not up")
        client = StandInDraft(address)
        connected.append(client)
        return client

    watcher = DraftVariantsWatcher(str(path), coordinator, connect, lambda a: [a], poll_seconds=0.01)
    return path, coordinator, watcher, connected, unreachable


async def settle(watcher):
    await watcher.poll()
    await asyncio.sleep(0.01)  # let connections finish
    await watcher.poll()


def pools(coordinator):
    return {p.name: (p.weight, sorted(c.name for c in p.replicas)) for p in coordinator.drafts}


def test_file_format_is_checked():
    specs = parse_draft_variants('{"variants": [{"name": "stable", "weight": 90, "addresses": ["d:50051"]},'
                                 ' {"name": "canary", "weight": 10, "addresses": ["c:50051", "c2:50051"]}]}')
    assert [(s.name, s.weight, s.addresses) for s in specs] == [("stable", 90.0, ("d:50051",)), ("canary", 10.0, ("c:50051", "c2:50051"))]
    for bad in ['[]', '{"variants": [{"weight": 1}]}', '{"variants": [{"name": "a", "weight": -1, "addresses": []}]}',
                '{"variants": [{"name": "a", "addresses": ["nohost"]}]}', 'not json',
                '{"variants": [{"name": "a", "addresses": []}, {"name": "a", "addresses": []}]}']:
        with pytest.raises(InvalidArgument):
            parse_draft_variants(bad)


def test_changes_apply_without_a_restart(setup):
    path, coordinator, watcher, connected, unreachable = setup

    async def main():
        write(path, [{"name": "stable", "weight": 90, "addresses": ["a:1"]}])
        await settle(watcher)
        assert pools(coordinator) == {"stable": (90.0, ["a:1"])}
        assert not await watcher.poll()  # unchanged file: nothing to do

        # A canary joins; its replica answers only later, and it gets no request before then.
        unreachable.add("b:1")
        write(path, [{"name": "stable", "weight": 90, "addresses": ["a:1"]}, {"name": "canary", "weight": 10, "addresses": ["b:1"]}])
        await settle(watcher)
        assert pools(coordinator) == {"stable": (90.0, ["a:1"]), "canary": (10.0, [])}
        assert {pick_variant(coordinator.drafts, random.Random(i)).name for i in range(50)} == {"stable"}
        unreachable.discard("b:1")
        await settle(watcher)  # retried at the next poll
        assert pools(coordinator)["canary"] == (10.0, ["b:1"])

        # Weights move; the split follows.
        write(path, [{"name": "stable", "weight": 50, "addresses": ["a:1"]}, {"name": "canary", "weight": 50, "addresses": ["b:1"]}])
        await settle(watcher)
        assert pools(coordinator) == {"stable": (50.0, ["a:1"]), "canary": (50.0, ["b:1"])}
        picks = [pick_variant(coordinator.drafts, random.Random(i)).name for i in range(400)]
        assert 150 < picks.count("canary") < 250

        # The canary is promoted: stable removed while a sequence is still pinned to its replica.
        stable = next(p for p in coordinator.drafts if p.name == "stable")
        pinned = stable.pick()
        write(path, [{"name": "canary", "weight": 100, "addresses": ["b:1", "c:1"]}])
        await settle(watcher)
        assert pools(coordinator)["canary"] == (100.0, ["b:1", "c:1"])
        assert stable in coordinator.drafts and stable.weight == 0 and not stable.replicas  # no new requests
        assert not pinned.closed  # its sequence finishes on it
        assert {pick_variant(coordinator.drafts, random.Random(i)).name for i in range(50)} == {"canary"}
        stable.unpin(pinned)  # the sequence finished
        await settle(watcher)
        assert pinned.closed and pools(coordinator) == {"canary": (100.0, ["b:1", "c:1"])}

        # An address leaves a variant that stays.
        write(path, [{"name": "canary", "weight": 100, "addresses": ["c:1"]}])
        await settle(watcher)
        assert pools(coordinator) == {"canary": (100.0, ["c:1"])}
        assert [c.closed for c in connected if c.name == "b:1"] == [True]

    asyncio.run(main())


def test_a_broken_edit_keeps_the_last_good_variants(setup):
    path, coordinator, watcher, _, _ = setup

    async def main():
        write(path, [{"name": "stable", "weight": 1, "addresses": ["a:1"]}])
        await settle(watcher)
        path.write_text('{"variants": [{"name": "stable", "weight": "lots"}]}')
        with pytest.raises(InvalidArgument):
            await watcher.poll()
        assert pools(coordinator) == {"stable": (1.0, ["a:1"])}
        write(path, [{"name": "stable", "weight": 2, "addresses": ["a:1"]}])
        await settle(watcher)  # a later good file applies
        assert pools(coordinator) == {"stable": (2.0, ["a:1"])}

    asyncio.run(main())


def test_ngram_variants_are_checked():
    specs = parse_draft_variants('{"variants": [{"name": "stable", "addresses": ["d:1"]},'
                                 ' {"name": "lookup", "weight": 10, "proposer": "ngram", "ngram_max": 3, "ngram_min": 2},'
                                 ' {"name": "remote", "proposer": "ngram", "addresses": ["n:1"]}]}')
    assert [(s.name, s.proposer, s.in_process) for s in specs] == [
        ("stable", "model", False), ("lookup", "ngram", True), ("remote", "ngram", False)]
    assert (specs[1].ngram_max, specs[1].ngram_min) == (3, 2) and (specs[2].ngram_max, specs[2].ngram_min) == (4, 1)
    for bad in ['{"variants": [{"name": "a", "proposer": "eagle"}]}',
                '{"variants": [{"name": "a", "proposer": "ngram", "ngram_max": 1, "ngram_min": 2}]}',
                '{"variants": [{"name": "a", "proposer": "ngram", "ngram_max": "4"}]}',
                '{"variants": [{"name": "a", "ngram_max": 4, "addresses": ["d:1"]}]}']:
        with pytest.raises(InvalidArgument):
            parse_draft_variants(bad)


def test_an_ngram_canary_runs_in_the_coordinator(setup):
    path, coordinator, watcher, connected, _ = setup

    async def main():
        write(path, [{"name": "stable", "weight": 90, "addresses": ["a:1"]},
                     {"name": "lookup", "weight": 10, "proposer": "ngram", "ngram_max": 3}])
        await settle(watcher)
        assert pools(coordinator) == {"stable": (90.0, ["a:1"]), "lookup": (10.0, ["in-process-ngram[1-3]"])}
        (client,) = next(p for p in coordinator.drafts if p.name == "lookup").replicas
        assert client.proposer_kind == "ngram" and client.proposer.max_n == 3
        assert [c.name for c in connected] == ["a:1"]  # nothing to connect to for the n-gram variant
        # Its sizes change: a new proposer; sequences pinned to the old one finish there.
        pool = next(p for p in coordinator.drafts if p.name == "lookup")
        pinned = pool.pick()
        write(path, [{"name": "stable", "weight": 90, "addresses": ["a:1"]},
                     {"name": "lookup", "weight": 50, "proposer": "ngram", "ngram_max": 5, "ngram_min": 2}])
        await settle(watcher)
        assert pools(coordinator)["lookup"] == (50.0, ["in-process-ngram[2-5]"])
        assert any(c is pinned for _, c in watcher._retiring)
        pool.unpin(pinned)
        write(path, [{"name": "stable", "weight": 100, "addresses": ["a:1"]}])  # the canary removed
        await settle(watcher)
        await settle(watcher)
        assert pools(coordinator) == {"stable": (100.0, ["a:1"])}

    asyncio.run(main())


def test_a_replica_of_another_proposer_kind_is_refused(setup):
    path, coordinator, watcher, connected, _ = setup

    async def main():
        write(path, [{"name": "lookup", "proposer": "ngram", "addresses": ["m:1"]}])
        await settle(watcher)  # the stand-in replica says nothing of its kind: a model draft
        assert pools(coordinator) == {"lookup": (1.0, [])}
        assert connected and connected[0].closed

    asyncio.run(main())
