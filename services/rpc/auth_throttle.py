"""Repeated authentication failures from one peer are throttled: after MAX_FAILURES failed calls within WINDOW
seconds the peer is locked out (every call refused with RESOURCE_EXHAUSTED, its token not even checked) for a
back-off that doubles with each lock-out, from 1 s up to 60 s. Guessing a token then runs at a few tries a minute
instead of thousands a second.

A peer is its IP address (not its port: a new connection must not start afresh). Clients behind one NAT address
share its lock-out; a valid token always works again once the lock-out ends, and any success clears the count.
"""

import time

MAX_FAILURES = 10
WINDOW_SECONDS = 60.0
FIRST_LOCKOUT_SECONDS = 1.0
MAX_LOCKOUT_SECONDS = 60.0
MAX_PEERS_TRACKED = 10_000  # bounds memory under a spray of addresses; the oldest are forgotten first


def peer_address(peer: str | None) -> str:
    """'ipv4:10.0.0.7:51234' or 'ipv6:[::1]:51234' -> the address without the port."""
    if not peer:
        return "?"
    address = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    if address.startswith("["):
        return address[1 : address.find("]")]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


class FailureThrottle:
    def __init__(self, max_failures=MAX_FAILURES, window=WINDOW_SECONDS, first_lockout=FIRST_LOCKOUT_SECONDS,
                 max_lockout=MAX_LOCKOUT_SECONDS, clock=time.monotonic):
        self.max_failures, self.window = max_failures, window
        self.first_lockout, self.max_lockout = first_lockout, max_lockout
        self.clock = clock
        self._failures: dict[str, list[float]] = {}
        self._locked: dict[str, tuple[float, int]] = {}  # peer -> (locked until, lock-outs so far)

    def locked_for(self, peer: str) -> float:
        """Seconds this peer stays locked out (0 = not locked)."""
        until, _ = self._locked.get(peer, (0.0, 0))
        return max(0.0, until - self.clock())

    def failed(self, peer: str) -> None:
        now = self.clock()
        recent = [t for t in self._failures.pop(peer, []) if now - t < self.window] + [now]
        if len(recent) >= self.max_failures:
            _, count = self._locked.get(peer, (0.0, 0))
            self._locked[peer] = (now + min(self.max_lockout, self.first_lockout * 2**count), count + 1)
            recent = []
        self._failures[peer] = recent
        for table in (self._failures, self._locked):
            while len(table) > MAX_PEERS_TRACKED:
                table.pop(next(iter(table)))

    def succeeded(self, peer: str) -> None:
        self._failures.pop(peer, None)
