"""Replica choice: sequences are pinned to the least-loaded live replica of a pool (or to its preferred replica, the
co-located target, while that one is live); draft pools are variants (canaries) chosen per request by weight, sticky
for the request's life."""

import random
from dataclasses import dataclass, field


@dataclass
class ReplicaPool:
    name: str
    replicas: list = field(default_factory=list)   # DraftClient or TargetClient objects
    weight: float = 1.0
    load: dict = field(default_factory=dict)       # replica name -> pinned sequences
    down: set = field(default_factory=set)         # replica names that failed and have not come back
    preferred: str | None = None                   # taken while live (the target in the coordinator's process)

    def live(self) -> list:
        return [r for r in self.replicas if r.name not in self.down]

    def pick(self):
        """The least-loaded live replica, or None when every replica is down."""
        live = self.live()
        if not live:
            return None
        preferred = [r for r in live if r.name == self.preferred]
        replica = preferred[0] if preferred else min(live, key=lambda r: self.load.get(r.name, 0))
        self.load[replica.name] = self.load.get(replica.name, 0) + 1
        return replica

    def mark_down(self, replica) -> None:
        self.down.add(replica.name)

    def unpin(self, replica) -> None:
        if replica is not None and self.load.get(replica.name, 0) > 0:
            self.load[replica.name] -= 1


def pick_variant(pools: list[ReplicaPool], rng: random.Random) -> ReplicaPool | None:
    """A draft variant by weight among pools with a live replica and a positive weight."""
    candidates = [p for p in pools if p.weight > 0 and p.live()]
    if not candidates:
        return None
    return rng.choices(candidates, weights=[p.weight for p in candidates])[0]
