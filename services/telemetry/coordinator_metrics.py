"""The coordinator's Prometheus metrics, fed by its observer events (a batch's "prefill" and "round", a request's
"finish" or "error": one call per batch, not per sequence) and its worker-call timings. Speculation counters live in `CanaryStats` (plain integers under a lock, so the round
loop does no label lookups) and are exported from there when scraped; latencies are histograms.

Exported (variant = the draft variant that served the request; "none" = the target alone; method = how the target
accepted proposals: "rejection", lossless, or "typical", NOT lossless, so the two are never mixed in one series):
  specsplit_drafted_tokens_total{variant,method}, specsplit_accepted_tokens_total{variant,method}
  specsplit_speculative_rounds_total{variant,method}
  specsplit_drafted_position_total{variant,method,position}, specsplit_accepted_position_total{variant,method,position}
  specsplit_acceptance_rate{variant,method}, specsplit_acceptance_rate_by_position{variant,method,position}
  specsplit_mean_accepted_length{variant,method}  tokens emitted per speculative round (accepted + 1)
  specsplit_system_efficiency{variant,method}     emitted / ((k+1) per round)
  specsplit_requests_total{variant,finish_reason}
  specsplit_draft_variant_proposer{variant,proposer}  1 per configured variant, its replicas' proposer kind
                                                ("model" or "ngram"), to join the variant series on
  specsplit_stage_latency_seconds{stage}        prefill / propose / verify worker calls, as round trips
  specsplit_speculation_length                  k the speculation policy chose per round (0 = plain decoding)
  specsplit_round_seconds{variant}              one round of the batch loop: time between its commits, once per
                                                round for each variant the round served
  specsplit_time_to_first_token_seconds{variant}, specsplit_inter_token_latency_seconds{variant}
  specsplit_queue_depth{role="coordinator"}, specsplit_running_sequences{role="coordinator"}
"""

import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specsplit.services.target.acceptance_method import ACCEPTANCE_METHODS
from specsplit.services.telemetry.canary_stats import NO_VARIANT, CanaryStats
from specsplit.services.telemetry.worker_telemetry import STAGE_BUCKETS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CoordinatorMetrics:
    def __init__(self, coordinator, canary: CanaryStats | None = None, registry: CollectorRegistry | None = None):
        self.coordinator = coordinator
        self.canary = canary or CanaryStats(lambda: coordinator.drafts)
        self.by_method = CanaryStats()  # the same totals keyed by (variant, acceptance method), for the metrics
        self.registry = registry or CollectorRegistry()
        self.stage_latency = Histogram(
            "specsplit_stage_latency_seconds", "Round trip of the coordinator's worker calls by stage",
            ["stage"], registry=self.registry, buckets=STAGE_BUCKETS,
        )
        self.round_time = Histogram(
            "specsplit_round_seconds", "Time of one round of the batch loop (between its commits), per variant served",
            ["variant"], registry=self.registry, buckets=STAGE_BUCKETS,
        )
        self.ttft = Histogram(
            "specsplit_time_to_first_token_seconds", "From submission to the first token",
            ["variant"], registry=self.registry, buckets=LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "specsplit_inter_token_latency_seconds", "Per request, (total - time to first token) / (tokens - 1)",
            ["variant"], registry=self.registry, buckets=STAGE_BUCKETS,
        )
        self.speculation_length = Histogram(
            "specsplit_speculation_length", "Proposals per sequence the speculation policy chose for a round",
            registry=self.registry, buckets=tuple(range(0, 17)),
        )
        self.registry.register(_SpeculationCollector(self))
        for stage in ("prefill", "propose", "verify"):
            self.stage_latency.labels(stage)  # every series exists from the start, at zero
        self._last_round: dict[str, tuple[int, float]] = {}  # variant -> (number, commit time) of its last round
        self._round_number = 0

    def attach(self) -> "CoordinatorMetrics":
        """Start recording the coordinator's events (observer) and call timings."""
        self.coordinator.observers.append(self.observe)
        self.coordinator.telemetry.metrics = self
        return self

    def observe_round(self, k: int) -> None:
        self.speculation_length.observe(k)

    def observe_call(self, method: str, seconds: float) -> None:
        self.stage_latency.labels(method).observe(seconds)

    def observe(self, event: str, records: list) -> None:
        """`records`: sequences ("prefill", "finish", "error") or (sequence, drafted, accepted) per sequence of a
        round ("round")."""
        now = time.perf_counter()
        if event == "round":
            variants = set()
            rounds, by_method = [], []
            for sequence, drafted, accepted in records:
                variant = sequence.draft_variant or NO_VARIANT
                variants.add(variant)
                if drafted > 0:
                    rounds.append((variant, drafted, accepted))
                    by_method.append(((variant, sequence.acceptance_method), drafted, accepted))
            self._round_number += 1
            for variant in variants:
                number, last = self._last_round.get(variant, (0, now))
                if number == self._round_number - 1:  # the variant was served by the round before too
                    self.round_time.labels(variant).observe(now - last)
                self._last_round[variant] = (self._round_number, now)
            if rounds:
                self.canary.add_rounds(rounds)
                self.by_method.add_rounds(by_method)
            return
        for sequence in records:
            variant = sequence.draft_variant or NO_VARIANT
            if event == "prefill":
                self.ttft.labels(variant).observe((sequence.first_token_at or now) - sequence.started)
                continue
            total = now - sequence.started
            tokens = len(sequence.generated)
            self.canary.add_request(variant, sequence.finish_reason or event, tokens, total)
            if sequence.first_token_at is not None and tokens > 1:
                self.itl.labels(variant).observe((total - (sequence.first_token_at - sequence.started)) / (tokens - 1))


class _SpeculationCollector:
    """Counters and ratios from the canary totals, and the coordinator's queue, read when scraped."""

    def __init__(self, metrics: CoordinatorMetrics):
        self.metrics = metrics

    def collect(self):
        totals = self.metrics.canary.snapshot()
        by_method = self.metrics.by_method.snapshot()
        # Configured variants show up before their first request, every method at zero until it is used.
        for name in [*totals, *(pool.name for pool in list(self.metrics.coordinator.drafts))]:
            for method in ACCEPTANCE_METHODS:
                by_method.setdefault((name, method), None)

        def counter(name, help_text, labels=("variant", "method")):
            return CounterMetricFamily(name, help_text, labels=list(labels))

        def gauge(name, help_text, labels=("variant", "method")):
            return GaugeMetricFamily(name, help_text, labels=list(labels))

        drafted = counter("specsplit_drafted_tokens", "Draft tokens proposed and verified")
        accepted = counter("specsplit_accepted_tokens", "Draft tokens accepted by the target (method typical: NOT lossless)")
        rounds = counter("specsplit_speculative_rounds", "Rounds in which the draft proposed")
        per_position = ("variant", "method", "position")
        drafted_at = counter("specsplit_drafted_position", "Draft tokens proposed at each position", per_position)
        accepted_at = counter("specsplit_accepted_position", "Draft tokens accepted at each position", per_position)
        requests = counter("specsplit_requests", "Requests finished", ("variant", "finish_reason"))
        rate = gauge("specsplit_acceptance_rate", "Accepted / drafted tokens since start")
        rate_at = gauge("specsplit_acceptance_rate_by_position", "Acceptance rate at each proposal position", per_position)
        length = gauge("specsplit_mean_accepted_length", "Tokens emitted per speculative round (accepted + 1)")
        efficiency = gauge("specsplit_system_efficiency", "Emitted tokens / verified positions ((k+1) per round)")
        for name, t in totals.items():
            for reason, count in t.requests.items():
                requests.add_metric([name, reason], count)
        for labels, t in by_method.items():
            labels = list(labels)
            if t is None:
                drafted.add_metric(labels, 0)
                accepted.add_metric(labels, 0)
                rounds.add_metric(labels, 0)
                continue
            drafted.add_metric(labels, t.drafted)
            accepted.add_metric(labels, t.accepted)
            rounds.add_metric(labels, t.rounds)
            for i, (d, a) in enumerate(zip(t.drafted_per_position, t.accepted_per_position)):
                drafted_at.add_metric([*labels, str(i)], d)
                accepted_at.add_metric([*labels, str(i)], a)
                rate_at.add_metric([*labels, str(i)], a / d if d else 0.0)
            if t.rounds:
                rate.add_metric(labels, t.acceptance_rate)
                length.add_metric(labels, t.mean_accepted_length)
                efficiency.add_metric(labels, t.system_efficiency)
        coordinator = self.metrics.coordinator
        queue = gauge("specsplit_queue_depth", "Requests admitted but not yet running", ("role",))
        queue.add_metric(["coordinator"], len(coordinator.waiting))
        running = gauge("specsplit_running_sequences", "Requests decoding", ("role",))
        running.add_metric(["coordinator"], len(coordinator.running))
        proposers = gauge("specsplit_draft_variant_proposer", "A draft variant's proposer kind: model or ngram (1)",
                          ("variant", "proposer"))
        for pool in list(coordinator.drafts):
            for kind in sorted({_proposer_kind(r) for r in pool.replicas} - {None}):
                proposers.add_metric([pool.name, kind], 1)
        yield from (drafted, accepted, rounds, drafted_at, accepted_at, requests, rate, rate_at, length, efficiency, queue,
                    running, proposers)


def _proposer_kind(replica) -> str | None:
    """"model" or "ngram"; None for a gRPC replica that has not described itself yet."""
    if getattr(replica, "info", True) is None:
        return None
    return getattr(replica, "proposer_kind", "model")
