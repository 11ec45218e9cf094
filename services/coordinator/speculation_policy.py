"""How many tokens to speculate each round: chosen from live acceptance and the costs measured on this deployment,
so that speculation is never slower than plain decoding.

A round with k proposals yields E(k) = 1 + a + a^2 + ... + a^k tokens per sequence (a: the sequence's acceptance
rate per proposal) and costs T(B, k) = propose(B, k) + verify(B, k) at batch size B; plain decoding (k = 0) yields
one token for verify(B, 0). Each round takes the k in [0, k_max] with the most tokens per second summed over the
batch. Costs are the wall times of this coordinator's own worker calls (so network, host work and whatever else the
deployment pays are in them), kept per batch bucket and k as the least of the last few: interference (a graph
capture, a prefill served in the same worker step, a long catch-up) only ever adds time, so the least is the cost
of the round itself; rounds that ran beside prefills are not measured at all. A cost not measured is interpolated. A bucket starts by
measuring both ends (k_max and 0) a few times; an end not chosen for `refresh_interval` rounds is measured once
more; while k = 0 wins, a round now and then proposes one token to keep the acceptance estimate fresh: after
`probe_interval` rounds at first, then twice as long after each probe that leaves k = 0 winning, up to
`MAX_PROBE_BACKOFF` times longer (a draft that never agrees costs ever less; one that starts agreeing is noticed
within a few hundred rounds).

Acceptance is estimated per sequence from its own rounds (accepted / tested proposals, a proposal after the first
rejection is not tested), starting from the running rate of its draft variant, so a new request starts from what
the draft has been achieving. `fixed` turns all of this off: every round proposes k_max (benchmarks).
"""

from collections import deque
from dataclasses import dataclass, field

PRIOR_WEIGHT = 4.0       # proposals' worth of the variant's rate that a sequence's own estimate starts from
VARIANT_SMOOTHING = 0.2  # weight of a round in its draft variant's running acceptance rate
COST_SAMPLES = 5         # a cost is the least of this many latest measurements
SAMPLES_BEFORE_CHOOSING = 3
MAX_PROBE_BACKOFF = 8    # the interval between probes grows to at most this many times probe_interval


@dataclass
class Acceptance:
    """A sequence's acceptance record: proposals tested and accepted."""

    tested: float = 0.0
    accepted: float = 0.0

    def rate(self, prior: float) -> float:
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.tested + PRIOR_WEIGHT)


@dataclass
class BucketCosts:
    propose: dict[int, deque] = field(default_factory=dict)   # k -> latest call seconds
    verify: dict[int, deque] = field(default_factory=dict)    # k -> latest call seconds
    measured_at: dict[int, int] = field(default_factory=dict)  # k -> round of its latest measurement
    rounds: int = 0
    rounds_at_zero: int = 0                                   # consecutive rounds that chose k = 0
    probe_backoff: int = 1                                    # the probe interval's current multiple

    def count(self, k: int) -> int:
        return len(self.verify.get(k, ()))

    def verify_cost(self, k: int) -> float | None:
        return min(self.verify[k]) if k in self.verify else None

    def propose_cost(self, k: int) -> float | None:
        return min(self.propose[k]) if k in self.propose else None


def expected_tokens(rate: float, k: int) -> float:
    """E(k) = sum_{i=0..k} rate^i."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


def bucket_of(batch: int) -> int:
    return 1 << max(batch - 1, 0).bit_length()


class SpeculationPolicy:
    def __init__(self, max_k: int, fixed: bool = False, probe_interval: int = 32, refresh_interval: int = 256,
                 initial_rate: float = 0.7):
        self.max_k = max_k
        self.fixed = fixed
        self.probe_interval = probe_interval
        self.refresh_interval = refresh_interval
        self.initial_rate = initial_rate
        self.variant_rates: dict[str, float] = {}
        self.buckets: dict[int, BucketCosts] = {}

    # ---- what the coordinator reports ----------------------------------------------------------------------

    def record_acceptance(self, acceptance: Acceptance, variant: str, proposed: int, accepted: int) -> None:
        tested = accepted + (1 if accepted < proposed else 0)
        acceptance.tested += tested
        acceptance.accepted += accepted
        if tested:
            rate = self.variant_rates.get(variant, self.initial_rate)
            self.variant_rates[variant] = rate + VARIANT_SMOOTHING * (accepted / tested - rate)

    def record_costs(self, batch: int, k: int, propose_seconds: float, verify_seconds: float) -> None:
        costs = self.buckets.setdefault(bucket_of(batch), BucketCosts())
        costs.verify.setdefault(k, deque(maxlen=COST_SAMPLES)).append(verify_seconds)
        if k:
            costs.propose.setdefault(k, deque(maxlen=COST_SAMPLES)).append(propose_seconds)
        costs.measured_at[k] = costs.rounds

    # ---- the choice ---------------------------------------------------------------------------------------------

    def rate(self, acceptance: Acceptance, variant: str) -> float:
        return acceptance.rate(self.variant_rates.get(variant, self.initial_rate))

    def choose(self, rates: list[float], batch: int, limit: int) -> int:
        """k for a round of `batch` decoding sequences whose speculating ones have acceptance `rates`; at most
        `limit` (the configured k, the requests' own caps)."""
        limit = min(limit, self.max_k)
        if self.fixed or limit <= 0 or not rates:
            return max(limit, 0)
        costs = self.buckets.setdefault(bucket_of(batch), BucketCosts())
        costs.rounds += 1
        # Measure both ends first, a few times each: the largest k and plain decoding; then keep them fresh. Any
        # k measured enough will do as the top end: a round whose cap is lower (a request's last tokens) interpolates
        # below it rather than measuring its own cap.
        top = max((k for k in costs.verify if k > 0 and costs.count(k) >= SAMPLES_BEFORE_CHOOSING), default=None)
        if top is None or costs.rounds - costs.measured_at[top] > self.refresh_interval:
            return limit
        if costs.count(0) < SAMPLES_BEFORE_CHOOSING or costs.rounds - costs.measured_at[0] > self.refresh_interval:
            return 0
        best, best_rate = 0, len(rates) / costs.verify_cost(0)
        for k in range(1, limit + 1):
            throughput = sum(expected_tokens(r, k) for r in rates) / self._cost(costs, k, top)
            if throughput > best_rate:
                best, best_rate = k, throughput
        if best == 0:
            costs.rounds_at_zero += 1
            if costs.rounds_at_zero >= self.probe_interval * costs.probe_backoff:
                costs.rounds_at_zero = 0
                costs.probe_backoff = min(2 * costs.probe_backoff, MAX_PROBE_BACKOFF)
                return 1  # keep the acceptance estimate alive
        else:
            costs.rounds_at_zero, costs.probe_backoff = 0, 1
        return best

    @staticmethod
    def _cost(costs: BucketCosts, k: int, top: int) -> float:
        """propose + verify at k: measured if it was, else proposals cost in proportion to k and verification
        linearly between plain decoding and the largest measured k."""
        verify = costs.verify_cost(k)
        if verify is None:
            v0, vt = costs.verify_cost(0), costs.verify_cost(top)
            verify = v0 + (vt - v0) * k / top
        propose = costs.propose_cost(k)
        if propose is None:
            propose = costs.propose_cost(top) * k / top
        return propose + verify
