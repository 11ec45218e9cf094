"""Live per-draft-variant statistics: what a canary rollout compares.

The coordinator's loop adds to them (rounds and finished requests, via its observer); the metrics thread reads
them for /metrics, /v1/canary and GetDraftVariantStats, so every access holds one lock.

Definitions (over speculative rounds, i.e. rounds where the draft proposed at least one token):
- acceptance rate = accepted / drafted tokens; per position i = accepted at i / drafted at i;
- mean accepted length = tokens emitted per round = (accepted + rounds) / rounds (each round adds the target's
  corrected or bonus token);
- system efficiency = emitted / ((k+1) per round, summed) = (accepted + rounds) / (drafted + rounds);
- tokens/s = per finished request (stop or length), completion tokens / time since it was submitted.
"""

import threading
from dataclasses import dataclass, field

from specsplit.services.telemetry.confidence_intervals import RunningMoments, wilson

NO_VARIANT = "none"  # label of requests served by the target alone


@dataclass
class VariantTotals:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    tokens_per_second: RunningMoments = field(default_factory=RunningMoments)

    def add_round(self, num_drafted: int, num_accepted: int) -> None:
        self.rounds += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        while len(self.drafted_per_position) < num_drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def add_request(self, finish_reason: str, completion_tokens: int, seconds: float) -> None:
        self.requests[finish_reason] = self.requests.get(finish_reason, 0) + 1
        if finish_reason in ("stop", "length") and completion_tokens > 0 and seconds > 0:
            self.tokens_per_second.add(completion_tokens / seconds)

    @property
    def finished_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else None

    @property
    def system_efficiency(self) -> float | None:
        return (self.accepted + self.rounds) / (self.drafted + self.rounds) if self.rounds else None

    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def copy(self) -> "VariantTotals":
        moments = RunningMoments()
        moments.n, moments.mean, moments._m2 = self.tokens_per_second.n, self.tokens_per_second.mean, self.tokens_per_second._m2
        return VariantTotals(
            self.rounds, self.drafted, self.accepted, list(self.drafted_per_position),
            list(self.accepted_per_position), dict(self.requests), moments,
        )


class CanaryStats:
    def __init__(self, pools=lambda: []):
        self._pools = pools  # -> the coordinator's draft pools now (name and routing weight of each variant)
        self._lock = threading.Lock()
        self._totals: dict[str, VariantTotals] = {}

    def add_round(self, variant: str, num_drafted: int, num_accepted: int) -> None:
        with self._lock:
            self._variant(variant).add_round(num_drafted, num_accepted)

    def add_rounds(self, rounds: list[tuple[str, int, int]]) -> None:
        """Many sequences' rounds at once, (variant, drafted, accepted) each: one lock for a batch's round."""
        with self._lock:
            for variant, num_drafted, num_accepted in rounds:
                self._variant(variant).add_round(num_drafted, num_accepted)

    def add_request(self, variant: str, finish_reason: str, completion_tokens: int, seconds: float) -> None:
        with self._lock:
            self._variant(variant).add_request(finish_reason, completion_tokens, seconds)

    def snapshot(self) -> dict[str, VariantTotals]:
        """A consistent copy of every variant's totals (including target-only requests, under NO_VARIANT)."""
        with self._lock:
            return {name: totals.copy() for name, totals in self._totals.items()}

    def report(self) -> dict:
        """GET /v1/canary: the configured variants, in routing order, with their statistics."""
        totals = self.snapshot()
        pools = list(self._pools())
        return {"variants": [variant_report(p.name, p.weight, totals.get(p.name, VariantTotals())) for p in pools]}

    def to_pb(self):
        """The GetDraftVariantStats response."""
        from specsplit.proto.v1 import generation_pb2

        response = generation_pb2.DraftVariantStatsResponse()
        totals = self.snapshot()
        for pool in list(self._pools()):
            variant_totals = totals.get(pool.name, VariantTotals())
            variant = variant_report(pool.name, pool.weight, variant_totals)
            low, high = variant["acceptance_rate_ci95"] or (0.0, 0.0)
            tps_low, tps_high = variant["tokens_per_second_ci95"] or (0.0, 0.0)
            response.variants.add(
                name=variant["name"], weight=variant["weight"], requests=variant["requests"],
                drafted_tokens=variant["drafted_tokens"], accepted_tokens=variant["accepted_tokens"],
                acceptance_rate=variant["acceptance_rate"] or 0.0, acceptance_rate_low=low, acceptance_rate_high=high,
                tokens_per_second=variant["tokens_per_second"] or 0.0, tokens_per_second_low=tps_low,
                tokens_per_second_high=tps_high, acceptance_per_position=variant_totals.acceptance_per_position(),
            )
        return response

    def _variant(self, name: str) -> VariantTotals:
        totals = self._totals.get(name)
        if totals is None:
            totals = self._totals[name] = VariantTotals()
        return totals


def variant_report(name: str, weight: float, totals: VariantTotals) -> dict:
    """One variant as /v1/canary shows it; intervals are null until there is data for them."""
    acceptance_ci = wilson(totals.accepted, totals.drafted)
    tps = totals.tokens_per_second
    tps_ci = tps.interval()
    return {
        "name": name,
        "weight": int(weight) if float(weight).is_integer() else weight,
        "requests": totals.finished_requests,
        "drafted_tokens": totals.drafted,
        "accepted_tokens": totals.accepted,
        "acceptance_rate": totals.acceptance_rate,
        "acceptance_rate_ci95": list(acceptance_ci) if acceptance_ci else None,
        "tokens_per_second": tps.mean if tps.n else None,
        "tokens_per_second_ci95": list(tps_ci) if tps_ci else None,
    }
