"""How long the coordinator waits for one worker call before it calls the replica hung.

A replica that stops answering (SIGSTOP, a stuck device, a network partition) must cost about a second, not the
transport's minute. The bound for a call comes from that replica's own measured call times: a running estimate per
replica, call kind (prefill / propose / verify / release) and size bucket (the tokens the call computes, in powers of
two). A call that takes `factor` times its usual time is a fault; `floor` keeps fast calls from tripping on noise.

- A bucket not yet seen borrows the nearest measured bucket of the same replica and kind, scaled up linearly with
  the size (cost grows at most linearly with tokens, so this never undercuts).
- A kind never seen on a replica (its first calls: lazy allocation, long prefills) gets the warm-up allowance.
- Calls run one after another on a worker's compute thread, so a call that queues behind this coordinator's other
  calls to the same replica is allowed their expected time as well.
- A late call is a fault only if its replica also fails to answer a Describe (replica_health.py): one that answers is
  busy, not hung (a CUDA graph captured for a shape its warm-up did not cover, calls of other coordinators queued
  ahead), and is waited for up to `busy_seconds` in all.
"""

import math
from dataclasses import dataclass, field


@dataclass
class DeadlineSettings:
    floor_seconds: float = 1.0       # never less: scheduling noise on a loaded host is tens of milliseconds
    factor: float = 10.0             # a call taking this many times its usual time is a fault
    warm_up_seconds: float = 30.0    # a replica's first call of a kind, with nothing measured yet
    busy_seconds: float = 30.0       # the longest wait for a late call whose replica still answers (a stuck device
                                     # whose worker answers Describe is found after this long)
    smoothing: float = 0.2           # weight of a new measurement in the running estimate


@dataclass
class _Estimate:
    seconds: float
    count: int = 1


@dataclass
class CallDeadlines:
    settings: DeadlineSettings = field(default_factory=DeadlineSettings)
    _estimates: dict = field(default_factory=dict)   # (replica, kind, bucket) -> _Estimate
    _in_flight: dict = field(default_factory=dict)   # replica -> {call id: expected seconds}
    _next_id: int = 0

    def deadline(self, replica: str, kind: str, size: int) -> float:
        """Seconds to wait for a call of `size` tokens of `kind` on `replica`, counting the calls already queued
        there by this coordinator."""
        queued = sum(self._in_flight.get(replica, {}).values())
        return max(self.settings.floor_seconds, self.settings.factor * (self.expected(replica, kind, size) + queued))

    def expected(self, replica: str, kind: str, size: int) -> float:
        """The usual duration of such a call; the warm-up allowance (divided by the factor) when nothing is known."""
        bucket = _bucket(size)
        exact = self._estimates.get((replica, kind, bucket))
        if exact is not None:
            return exact.seconds
        known = [(b, e.seconds) for (r, k, b), e in self._estimates.items() if r == replica and k == kind]
        if not known:
            return self.settings.warm_up_seconds / self.settings.factor
        nearest, seconds = min(known, key=lambda item: abs(item[0] - bucket))
        return seconds * max(1.0, 2.0 ** (bucket - nearest))

    def observe(self, replica: str, kind: str, size: int, seconds: float) -> None:
        key = (replica, kind, _bucket(size))
        estimate = self._estimates.get(key)
        if estimate is None:
            self._estimates[key] = _Estimate(seconds)
            return
        # The first calls of a kind may include one-off costs; the running mean forgets them quickly.
        weight = max(self.settings.smoothing, 1.0 / (estimate.count + 1))
        estimate.seconds += weight * (seconds - estimate.seconds)
        estimate.count += 1

    def started(self, replica: str, kind: str, size: int) -> int:
        """Record a call in flight (it delays later calls to the same replica); returns its id for `ended`."""
        self._next_id += 1
        self._in_flight.setdefault(replica, {})[self._next_id] = self.expected(replica, kind, size)
        return self._next_id

    def ended(self, replica: str, call_id: int) -> None:
        self._in_flight.get(replica, {}).pop(call_id, None)


def _bucket(size: int) -> int:
    """Size bucket: 0 for one token, then one per power of two."""
    return math.ceil(math.log2(size)) if size > 1 else 0


def add_call_deadline_args(parser) -> None:
    defaults = DeadlineSettings()
    parser.add_argument("--hung-call-floor-seconds", type=float, default=defaults.floor_seconds,
                        help="a worker call is never called hung sooner than this")
    parser.add_argument("--hung-call-factor", type=float, default=defaults.factor,
                        help="a worker call taking this many times that replica's usual time for it is a fault: the "
                             "replica is marked down and its sequences move on")
    parser.add_argument("--first-call-seconds", type=float, default=defaults.warm_up_seconds,
                        help="the bound for a replica's first call of a kind, before any is measured")
    parser.add_argument("--busy-call-seconds", type=float, default=defaults.busy_seconds,
                        help="a late call whose replica still answers Describe (busy, not hung: a graph capture, "
                             "other coordinators' calls ahead) is waited for up to this long in all")


def deadline_settings_from_args(args) -> DeadlineSettings:
    return DeadlineSettings(floor_seconds=args.hung_call_floor_seconds, factor=args.hung_call_factor,
                            warm_up_seconds=args.first_call_seconds, busy_seconds=args.busy_call_seconds)
