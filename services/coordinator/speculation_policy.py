"""How many tokens to speculate each round: chosen from live acceptance and the costs measured on this deployment,
so that speculation is never slower than plain decoding.

A round with k proposals yields E(k) = 1 + a + a^2 + ... + a^k tokens per sequence (a: the sequence's acceptance
rate per proposal) and costs T(B, k) = propose(B, k) + verify(B, k) at batch size B; plain decoding (k = 0) yields
one token for verify(B, 0). Each round takes the k in [0, limit] with the most tokens per second summed over the
batch; of ks predicted within FEWER_MARGIN of the most (scaled by 1 - 1/B: nothing at batch 1), the fewest: as
fast, and a round of fewer proposals varies less in what it yields, so a batch that ends together waits less for
its last sequence.

Costs are the wall times of this coordinator's own worker calls (so network, host work and whatever else the
deployment pays are in them), kept per batch bucket and k as the least of the last few: interference (a graph
capture, a prefill served in the same worker step, a long catch-up) only ever adds time, so the least is the cost
of the round itself; rounds that ran beside prefills are not measured at all. The verification's cost and the
proposals' are predicted apart (round_costs): piecewise linear between the measured ks, beyond them along the last
measured slope, and neither ever cheaper at a k than at a larger one (a cheap measurement is trustworthy, a dear one
may carry interference: so a plain round measured dear cannot make proposals look free). A bucket that has not
measured both plain decoding and some k > 0 borrows the curves of the nearest bucket that has, scaled to whatever it
measured itself (the ratio of throughputs, which is all the choice needs, does not depend on the scale).

Exploration. The first bucket measures plain decoding, then one proposal (the cheapest way to learn what the draft
costs and whether it agrees), then the k predicted best from the two; a later bucket starts from the borrowed curve.
Each bucket measures plain decoding (up to BASELINE_SAMPLES times) once it has run BASELINE_AFTER rounds (a bucket
that only lives through a batch's last rounds never pays for it). Every k a round runs is measured, and a neighbour
of the chosen k (one more, one fewer) is tried when predicted within EXPLORE_MARGIN of it if never measured or stale
(not measured for `refresh_interval` rounds), and again every REMEASURE_INTERVAL rounds while it has fewer than
COST_SAMPLES measurements, within a margin widened in proportion (one measurement can carry much interference, and a
k that looks slow is never chosen to be measured again); so the choice climbs to the best k and follows costs that
drift, at the price of a round now and then.
While k = 0 wins, a round now and then proposes one token to keep the acceptance estimate fresh: after
`probe_interval` rounds at first, then twice as long after each probe that leaves k = 0 winning, up to
MAX_PROBE_BACKOFF times longer (a draft that never agrees costs ever less). A probe asks whether the draft has
changed since it was switched off, which older evidence cannot answer, so the verdicts of the sequences it probes
(those that follow the policy; a fixed-k request proposing beside it counts as in any round) count as PROBE_WEIGHT
proposals, shared among them, in the variant's rate, and one that agreed brings the next probe back to
`probe_interval`: a draft that starts agreeing is speculating again within a few probes.

What a useless draft costs while attached is paid only when speculation is likely: `worth_drafting` tells the
coordinator whether a new sequence should have its draft KV built (its draft variant's rate makes some k > 0 win at
this batch size, or nothing is known yet), and `probe_due` asks it to attach one sequence when a probe is due and
none can propose.

Acceptance is estimated per sequence from its own rounds (accepted / tested proposals, a proposal after the first
rejection is not tested), starting from its draft variant's running rate (fading sums over the last VARIANT_MEMORY
tested proposals) with the weight of PRIOR_WEIGHT proposals, so a new request starts from what the draft has been
achieving. An estimate from little evidence may be worse than the sequence is: when plain decoding wins on the
estimates but would not on OPTIMISM standard errors above them, the round proposes one token, which is the test.
`fixed` turns all of this off: every round proposes the limit (benchmarks, and what a request asks for explicitly).
"""

from collections import deque
from dataclasses import dataclass, field

import numpy as np

PRIOR_WEIGHT = 16.0      # proposals' worth of the variant's rate that a sequence's own estimate starts from
VARIANT_MEMORY = 256.0   # tested proposals a draft variant's running rate remembers (older ones fade)
OPTIMISM = 1.0           # standard errors above a sequence's estimate that still keep it speculating (see choose)
COST_SAMPLES = 5         # a cost is the least of this many latest measurements
BASELINE_SAMPLES = 2     # plain-decoding measurements a bucket takes (one first where nothing is known)
MAX_PROBE_BACKOFF = 8    # the interval between probes grows to at most this many times probe_interval
PROBE_WEIGHT = 32.0      # proposals' worth of evidence a probe round carries in its variant's rate
EXPLORE_MARGIN = 0.05    # an unmeasured (or stale) neighbour of the best k is tried when predicted this close to it
REMEASURE_INTERVAL = 16  # ... and again after this many rounds while it has fewer than COST_SAMPLES measurements
FEWER_MARGIN = 0.02      # the fewest proposals predicted within this of the best: as fast, less variance per round
BASELINE_AFTER = 8       # rounds a bucket runs on a borrowed curve before it measures plain decoding itself


def upper_rates(rates: list[float], evidence: list[float]) -> list[float]:
    """OPTIMISM standard errors above each rate, as far as its evidence (proposals' worth) allows; a rate without
    evidence (0: a sequence that does not follow the policy) stays as it is."""
    r, e = np.asarray(rates, dtype=np.float64), np.asarray(evidence, dtype=np.float64)
    spread = np.sqrt(np.divide(r * (1.0 - r), e, out=np.zeros_like(r), where=e > 0))
    return np.minimum(r + OPTIMISM * spread, 1.0).tolist()


@dataclass
class Acceptance:
    """A sequence's acceptance record: proposals tested and accepted."""

    tested: float = 0.0
    accepted: float = 0.0

    @property
    def evidence(self) -> float:
        """Proposals' worth behind rate(): its own tested ones and the prior's."""
        return self.tested + PRIOR_WEIGHT

    def rate(self, prior: float) -> float:
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.tested + PRIOR_WEIGHT)


@dataclass
class Probe:
    """A round chosen to probe a switched-off draft: its bucket, and how many proposals' worth each proposal tested
    by a probed sequence (one that follows the policy) counts for in its variant's rate."""

    costs: "BucketCosts"
    weight: float


@dataclass
class BucketCosts:
    propose: dict[int, deque] = field(default_factory=dict)   # k -> latest call seconds
    verify: dict[int, deque] = field(default_factory=dict)    # k -> latest call seconds
    measured_at: dict[int, int] = field(default_factory=dict)  # k -> round of its latest measurement
    tried_at: dict[int, int] = field(default_factory=dict)     # k -> round it was last chosen to be measured
    rounds: int = 0
    rounds_at_zero: int = 0                                   # consecutive rounds that chose k = 0
    probe_backoff: int = 1                                    # the probe interval's current multiple

    def count(self, k: int) -> int:
        return len(self.verify.get(k, ()))

    def verify_cost(self, k: int) -> float | None:
        return min(self.verify[k]) if k in self.verify else None

    def propose_cost(self, k: int) -> float | None:
        return min(self.propose[k]) if k in self.propose else None

    def costs_near(self, k: int) -> tuple[float | None, float | None]:
        """(propose, verify) seconds at k: as measured, else along the curves through what this bucket measured
        (`along`, as round_costs predicts them: a propose call of fewer steps in proportion). For the overlap
        decision, whose round k shrinks as the batch's requests near their ends."""
        propose = {m: self.propose_cost(m) for m in self.speculative()}
        if not propose:
            return None, None
        verify = {m: self.verify_cost(m) for m in self.verify}
        return along(propose, k, proportional_below=True), along(verify, k)

    def speculative(self) -> list[int]:
        """The k > 0 measured here."""
        return sorted(k for k in self.propose if k in self.verify)


def expected_tokens(rate: float, k: int) -> float:
    """E(k) = sum_{i=0..k} rate^i."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


def batch_expected_tokens(rates: list[float], max_k: int) -> list[float]:
    """sum over the batch of E(k), for k = 0..max_k."""
    if len(rates) > 8:
        powers = np.asarray(rates, dtype=np.float64)[:, None] ** np.arange(max_k + 1)
        return np.cumsum(powers.sum(axis=0)).tolist()
    sums, total, powers = [], 0.0, [1.0] * len(rates)
    for _ in range(max_k + 1):
        total += sum(powers)
        sums.append(total)
        powers = [p * r for p, r in zip(powers, rates)]
    return sums


def bucket_of(batch: int) -> int:
    return 1 << max(batch - 1, 0).bit_length()


def along(points: dict[int, float], k: int, proportional_below: bool = False) -> float:
    """The value at k of the piecewise-linear curve through `points` (k -> seconds), extended beyond the last point
    along the last segment's slope (never falling), or in proportion to k (from the origin) with one point only or,
    when `proportional_below`, below the first point (a propose call of fewer steps)."""
    if k in points:
        return points[k]
    below = [j for j in points if j < k]
    above = [j for j in points if j > k]
    if below and above:
        lo, hi = max(below), min(above)
        return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)
    if above:  # below the first point
        hi = min(above)
        if proportional_below or hi == 0:
            return points[hi] * k / hi if hi else points[hi]
        second = sorted(above)[1] if len(above) > 1 else None
        slope = (points[second] - points[hi]) / (second - hi) if second is not None else 0.0
        return max(points[hi] - max(slope, 0.0) * (hi - k), 0.0)
    top = max(below)
    lower = [j for j in below if j < top]
    if lower:
        prev = max(lower)
        slope = max((points[top] - points[prev]) / (top - prev), 0.0)
    else:
        slope = points[top] / top if top else 0.0
    return points[top] + slope * (k - top)


class SpeculationPolicy:
    def __init__(self, max_k: int, fixed: bool = False, probe_interval: int = 32, refresh_interval: int = 256,
                 initial_rate: float = 0.7):
        self.max_k = max_k
        self.fixed = fixed
        self.probe_interval = probe_interval
        self.refresh_interval = refresh_interval
        self.initial_rate = initial_rate
        self.variant_counts: dict[str, tuple[float, float]] = {}  # variant -> fading sums (tested, accepted)
        self.buckets: dict[int, BucketCosts] = {}
        self._predicted: dict[int, dict[int, float]] = {}  # bucket -> round_costs up to max_k, until a cost changes

    # ---- what the coordinator reports ----------------------------------------------------------------------

    def record_acceptance(self, acceptance: Acceptance, variant: str, proposed: int, accepted: int,
                          probe: Probe | None = None) -> None:
        """A round's verdict on a sequence's proposals; `probe`: the round's Probe (choose_round) where this sequence
        was probed (it follows the policy), None otherwise (a fixed-k or seeded request proposing beside a probe
        carries no more weight than in any other round)."""
        tested = accepted + (1 if accepted < proposed else 0)
        acceptance.tested += tested
        acceptance.accepted += accepted
        if tested:
            # Fading sums, not a running mean of each round's ratio: accepted / tested of one round is biased low
            # (a round ends at its first rejection), the sums' ratio is not. A probe's proposal stands for many: it
            # asks whether the draft has changed since it was switched off, which older evidence cannot answer.
            weight = probe.weight if probe is not None else 1.0
            old_tested, old_accepted = self.variant_counts.get(variant, (1.0, self.initial_rate))
            keep = max(0.0, 1.0 - weight * tested / VARIANT_MEMORY)
            self.variant_counts[variant] = (keep * old_tested + weight * tested,
                                            keep * old_accepted + weight * accepted)
            if accepted and probe is not None:
                probe.costs.probe_backoff = 1  # it agreed: ask again soon

    def record_costs(self, batch: int, k: int, propose_seconds: float, verify_seconds: float) -> None:
        costs = self.buckets.setdefault(bucket_of(batch), BucketCosts())
        before = (costs.verify_cost(k), costs.propose_cost(k))
        costs.verify.setdefault(k, deque(maxlen=COST_SAMPLES)).append(verify_seconds)
        if k:
            costs.propose.setdefault(k, deque(maxlen=COST_SAMPLES)).append(propose_seconds)
        costs.measured_at[k] = costs.rounds
        if (costs.verify_cost(k), costs.propose_cost(k)) != before:
            self._predicted.clear()  # the least of the latest changed (rarely, once measured): predict again

    # ---- the choice ---------------------------------------------------------------------------------------------

    def rate(self, acceptance: Acceptance, variant: str) -> float:
        return acceptance.rate(self.variant_rate(variant))

    def variant_rate(self, variant: str) -> float:
        tested, accepted = self.variant_counts.get(variant, (1.0, self.initial_rate))
        return accepted / tested

    def choose(self, rates: list[float], batch: int, limit: int, evidence: list[float] | None = None) -> int:
        """k for a round of `batch` decoding sequences (choose_round's k)."""
        return self.choose_round(rates, batch, limit, evidence)[0]

    def choose_round(self, rates: list[float], batch: int, limit: int,
                     evidence: list[float] | None = None) -> tuple[int, Probe | None]:
        """k for a round of `batch` decoding sequences, and the Probe when the round is one (for record_acceptance
        of the sequences it probes); `rates`: each one's acceptance (0 for one that does not follow the policy);
        `evidence`: the proposals' worth behind each rate (Acceptance.evidence; 0 for one that does not follow the
        policy; None: every rate is known for sure); at most `limit` (the configured k, the requests' own caps)."""
        limit = min(limit, self.max_k)
        if self.fixed:
            return max(limit, 0), None
        bucket = bucket_of(batch)
        costs = self.buckets.setdefault(bucket, BucketCosts())
        costs.rounds += 1
        if limit <= 0 or not rates:
            costs.rounds_at_zero += 1  # nobody can speculate: a probe comes nearer (probe_due), taken when one can
            return 0, None
        predicted = self._throughputs(bucket, rates, limit)
        if self._baseline_due(bucket, costs, predicted):
            costs.tried_at[0] = costs.rounds
            return 0, None
        if len(predicted) == 1:  # nothing known of speculating: the cheapest way to learn
            costs.tried_at[1] = costs.rounds
            return 1, None
        best = self._best(predicted, batch)
        for neighbour in (best + 1, best - 1):
            if (neighbour in predicted and self._uncertain(costs, neighbour)
                    and predicted[neighbour] >= (1.0 - self._explore_margin(costs, neighbour)) * predicted[best]):
                costs.tried_at[neighbour] = costs.rounds
                return neighbour, None
        if best == 0 and evidence is not None:
            # Plain decoding wins on the estimates, but a sequence with little evidence may be better than it looks;
            # a round of one proposal tests it, until the evidence says it is not (or it is).
            upper = upper_rates(rates, evidence)
            if upper != list(rates) and self._best(self._throughputs(bucket, upper, limit), batch) > 0:
                return 1, None
        if best == 0:
            if self._at_zero(costs):  # keep the acceptance estimate alive
                probed = sum(e > 0 for e in evidence) if evidence is not None else len(rates)
                return 1, Probe(costs, PROBE_WEIGHT / max(1, probed))
        else:
            costs.rounds_at_zero, costs.probe_backoff = 0, 1
        return best, None

    def worth_drafting(self, variant: str, batch: int) -> bool:
        """Whether a sequence of draft `variant` joining a batch of `batch` should have its draft KV built now:
        speculation at the variant's rate is predicted to win at this batch size, or nothing is known yet."""
        if self.fixed:
            return True
        predicted = self._throughputs(bucket_of(batch), [self.variant_rate(variant)], self.max_k)
        return len(predicted) <= 1 or self._best(predicted, batch) > 0

    def probe_due(self, batch: int) -> bool:
        """Whether this batch size's next round would probe, if a sequence had a draft to probe with."""
        costs = self.buckets.get(bucket_of(batch))
        return costs is not None and costs.rounds_at_zero + 1 >= self.probe_interval * costs.probe_backoff

    def round_costs(self, bucket: int, limit: int) -> dict[int, float]:
        """Predicted seconds of a round at each k in [0, limit] at this bucket, from its verification and proposal
        costs: its own once it measured plain decoding and some k > 0; else the nearest complete bucket's, each
        scaled to what this one measured of it (and its measurements kept); {0: cost} or {} while nothing anywhere
        says what speculating costs."""
        costs = self.buckets.get(bucket) or BucketCosts()
        verify = {k: costs.verify_cost(k) for k in costs.verify}
        propose = {k: costs.propose_cost(k) for k in costs.speculative()}
        if 0 not in verify or not propose:
            source = self._nearest_complete(bucket)
            if source is None:
                return {0: verify[0]} if 0 in verify else {}
            source_verify = {k: source.verify_cost(k) for k in source.verify}
            source_propose = {k: source.propose_cost(k) for k in source.speculative()}
            verify_scale = _mean_ratio(verify, source_verify, False, 1.0)
            propose_scale = _mean_ratio(propose, source_propose, True, verify_scale)
            verify = {**{k: verify_scale * along(source_verify, k) for k in range(limit + 1)}, **verify}
            propose = {**{k: propose_scale * along(source_propose, k, proportional_below=True)
                          for k in range(1, limit + 1)}, **propose}
        verify, propose = _never_cheaper_with_more(verify), _never_cheaper_with_more(propose)
        return {0: along(verify, 0), **{k: along(verify, k) + along(propose, k, proportional_below=True)
                                        for k in range(1, limit + 1)}}

    # ---- internals ------------------------------------------------------------------------------------------------

    @staticmethod
    def _best(predicted: dict[int, float], batch: int) -> int:
        """The fewest proposals predicted within FEWER_MARGIN (none at batch 1) of the most tokens per second: as
        fast, and a round of fewer proposals varies less in what it yields, so a batch that ends together waits less
        for its last sequence."""
        top = max(predicted.values())
        margin = FEWER_MARGIN * (1.0 - 1.0 / max(batch, 1))
        return min(k for k, v in predicted.items() if v >= (1.0 - margin) * top)

    def _throughputs(self, bucket: int, rates: list[float], limit: int) -> dict[int, float]:
        """Tokens per second for the batch at each k with a predicted cost (the costs computed once per bucket
        until a measurement changes them; the tokens summed over the batch in one pass per k)."""
        if bucket not in self._predicted:
            self._predicted[bucket] = self.round_costs(bucket, self.max_k)
        seconds = {k: v for k, v in self._predicted[bucket].items() if k <= limit and v > 0}
        if not seconds:
            return {}
        tokens = batch_expected_tokens(rates, max(seconds))
        return {k: tokens[k] / v for k, v in seconds.items()}

    def _baseline_due(self, bucket: int, costs: BucketCosts, predicted: dict) -> bool:
        """Plain decoding is measured first where nothing is known, after BASELINE_AFTER rounds of a bucket that
        borrows its curve (a bucket that only lives through a batch's last rounds never pays for it), until it has
        BASELINE_SAMPLES measurements, and again when stale."""
        if costs.count(0) >= BASELINE_SAMPLES:
            return self._stale(costs, 0)
        if len(predicted) <= 1:
            return not costs.count(0)
        return costs.rounds > BASELINE_AFTER and self._uncertain(costs, 0)

    def _stale(self, costs: BucketCosts, k: int) -> bool:
        """Never measured, or not for `refresh_interval` rounds, and not tried for as long (a round that could not
        be measured, beside a prefill, does not make it try again at once)."""
        last = max(costs.measured_at.get(k, -1 << 30), costs.tried_at.get(k, -1 << 30))
        return costs.rounds - last > self.refresh_interval

    def _uncertain(self, costs: BucketCosts, k: int) -> bool:
        """Stale, or measured fewer than COST_SAMPLES times and not tried for REMEASURE_INTERVAL rounds: a contender
        of the best k measured once may look slower than it is (its one measurement carried interference)."""
        if self._stale(costs, k):
            return True
        last = max(costs.measured_at.get(k, -1 << 30), costs.tried_at.get(k, -1 << 30))
        return costs.count(k) < COST_SAMPLES and costs.rounds - last > REMEASURE_INTERVAL

    @staticmethod
    def _explore_margin(costs: BucketCosts, k: int) -> float:
        """How much slower than the best a neighbour may look and still be tried: EXPLORE_MARGIN, widened in
        proportion for one measured fewer than COST_SAMPLES times (one measurement can carry a lot of interference,
        and a k that looks slow is never measured again by being chosen)."""
        count = costs.count(k)
        return EXPLORE_MARGIN * COST_SAMPLES / count if count else EXPLORE_MARGIN

    def _at_zero(self, costs: BucketCosts) -> bool:
        """Count a round at k = 0; True when it is a probe's turn instead."""
        costs.rounds_at_zero += 1
        if costs.rounds_at_zero >= self.probe_interval * costs.probe_backoff:
            costs.rounds_at_zero = 0
            costs.probe_backoff = min(2 * costs.probe_backoff, MAX_PROBE_BACKOFF)
            return True
        return False

    def _nearest_complete(self, bucket: int) -> BucketCosts | None:
        """The bucket nearest to `bucket` (in powers of two, the smaller first) that measured k = 0 and some k > 0."""
        known = [b for b, c in self.buckets.items() if b != bucket and c.verify_cost(0) and c.speculative()]
        if not known:
            return None
        return self.buckets[min(known, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))]


def _never_cheaper_with_more(points: dict[int, float]) -> dict[int, float]:
    """A call for more rows or steps never costs less: a k measured cheaper than a lower one bounds it (the lower
    one's few measurements carried interference, which only ever adds time)."""
    out = dict(points)
    ks = sorted(out, reverse=True)
    for higher, lower in zip(ks, ks[1:]):
        out[lower] = min(out[lower], out[higher])
    return out


def _mean_ratio(here: dict[int, float], there: dict[int, float], proportional_below: bool, default: float) -> float:
    """How much costlier this bucket's measured points are than another bucket's curve at the same ks."""
    ratios = [v / along(there, k, proportional_below) for k, v in here.items() if along(there, k, proportional_below)]
    return sum(ratios) / len(ratios) if ratios else default
