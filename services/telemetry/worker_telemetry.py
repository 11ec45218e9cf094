"""A draft or target worker's telemetry: spans of its batched steps and its Prometheus metrics.

One GPU step serves items from many calls (and several coordinators), each item a different request. So:
- every item gets its own span, a child of its request's span from the coordinator (propagated per item, see
  trace_propagation): `prefill` or `propose` on a draft; `prefill`, `score` (the target forward) and `verify`
  (acceptance) on a target; each with k, accepted count, batch size and queue wait;
- the step itself gets one span (`draft.step` / `target.step`) that links to every item's request span, and
  each item span links back to it: one step's time is shared, never charged to one request.

Metrics are always kept (cheap); spans only when tracing is on.
"""

import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specsplit.services.telemetry import tracing
from specsplit.services.telemetry.trace_propagation import item_contexts

STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ForwardClock:
    """Times the model forwards of a step, so a target step splits into score (forward) and verify (the rest)."""

    ENTRY_POINTS = ("forward", "forward_flat", "run_step")  # the runner's ways into the model; nested calls time as one

    def __init__(self, runner):
        self.reset()
        for name in self.ENTRY_POINTS:
            if hasattr(runner, name):
                setattr(runner, name, self._timed(getattr(runner, name)))  # on this instance only

    def _timed(self, forward):
        def timed_forward(*args, **kwargs):
            start = time.time_ns()
            try:
                return forward(*args, **kwargs)
            finally:
                self.first_start = self.first_start or start
                self.last_end = time.time_ns()

        return timed_forward

    def reset(self) -> None:
        self.first_start = 0
        self.last_end = 0


class WorkerTelemetry:
    def __init__(self, role: str, runner, sequences, registry: CollectorRegistry | None = None, proposer: str = "",
                 decode_ahead=None):
        """`proposer`: a draft's proposer kind ("model" or "ngram"), exported as specsplit_draft_proposer{proposer}
        and on the draft's spans; `runner` None: a draft without a model (no KV gauges). `decode_ahead`: a
        target's DecodeAhead (target/decode_ahead.py), whose row counts are exported."""
        self.role = role
        self.decode_ahead = decode_ahead
        self.proposer = proposer
        self.runner = runner
        self.sequences = sequences
        self.batcher = None
        self.registry = registry or CollectorRegistry()
        self.stage_latency = Histogram(
            "specsplit_stage_latency_seconds", "Time of a worker step's stage (propose, score, verify, prefill)",
            ["stage"], registry=self.registry, buckets=STAGE_BUCKETS,
        )
        self.batch_size = Histogram(
            "specsplit_step_batch_size", "Sequences per worker step", ["kind"], registry=self.registry, buckets=BATCH_BUCKETS
        )
        self.queue_wait = Histogram(
            "specsplit_queue_wait_seconds", "Time a call waits in the worker's batch queue before its step",
            ["kind"], registry=self.registry, buckets=STAGE_BUCKETS,
        )
        self.registry.register(_WorkerGauges(self))
        for stage in ("prefill", "score", "verify") if role == "target" else ("prefill", "propose"):
            self.stage_latency.labels(stage)  # every series exists from the start, at zero
        self.clock = ForwardClock(runner) if role == "target" and runner is not None else None
        self._arrivals: dict[int, tuple] = {}  # id(item) -> (its request's context or None, arrival ns)

    def watch(self, batcher) -> None:
        """The batcher whose queue depth /metrics reports."""
        self.batcher = batcher

    def instrument(self, handlers: dict) -> dict:
        """Wrap the step handlers that do model work; housekeeping (release, expire) runs as it is."""
        return {kind: self._step(kind, h) if kind in ("prefill", "propose", "verify") else h for kind, h in handlers.items()}

    def received(self, items: list, traceparents=()) -> list:
        """Note when a call's items arrived and, when tracing, which request each belongs to (the request's
        per-item traceparents); returns the items."""
        now = time.time_ns()
        contexts = item_contexts(traceparents, len(items)) if traceparents and tracing.enabled() else None
        for i, item in enumerate(items):
            self._arrivals[id(item)] = (contexts[i] if contexts else None, now)
        return items

    def _step(self, kind: str, handler):
        def step(items: list) -> list:
            if self.clock is not None:
                self.clock.reset()
            start = time.time_ns()
            try:
                results = handler(items)
            finally:
                end = time.time_ns()
                arrivals = [self._arrivals.pop(id(item), (None, start)) for item in items]
            self._record(kind, items, results, arrivals, start, end)
            return results

        return step

    def _record(self, kind, items, results, arrivals, start, end) -> None:
        forward = (self.clock.first_start, self.clock.last_end) if self.clock is not None and self.clock.last_end else None
        stages = self._stages(kind, start, end, forward)
        for stage, (s, e) in stages.items():
            self.stage_latency.labels(stage).observe((e - s) / 1e9)
        self.batch_size.labels(kind).observe(len(items))
        wait = self.queue_wait.labels(kind)
        for arrived in {arrived for _, arrived in arrivals}:  # once per call: its items arrived together
            wait.observe(max(0, start - arrived) / 1e9)
        if tracing.enabled() and any(c is not None for c, _ in arrivals):
            per_item = results if isinstance(results, list) else [results] * len(items)
            self._spans(kind, items, per_item, arrivals, start, end, stages)

    def _stages(self, kind, start, end, forward) -> dict[str, tuple[int, int]]:
        if kind == "verify" and forward is not None:
            return {"score": forward, "verify": (forward[1], end)}
        if kind == "verify":  # every item failed before the forward
            return {"verify": (start, end)}
        return {kind: (start, end)}

    def _spans(self, kind, items, results, arrivals, start, end, stages) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Link, Status, StatusCode

        tracer = tracing.tracer()
        # Requests the sampler left out (unsampled parents) get no spans here either, nor does a step serving only them.
        sampled = [trace.get_current_span(c).get_span_context() for c, _ in arrivals if c is not None]
        sampled = [c for c in sampled if c.trace_flags.sampled]
        if not sampled:
            return
        step = tracer.start_span(
            f"{self.role}.step",
            context=trace.set_span_in_context(trace.INVALID_SPAN),  # its own trace: it serves many
            links=[Link(c) for c in sampled],
            start_time=start,
            attributes={"specsplit.step.kind": kind, "specsplit.batch_size": len(items), "specsplit.role": self.role,
                        **({"specsplit.proposer": self.proposer} if self.proposer else {})},
        )
        step.end(end_time=end)
        back = [Link(step.get_span_context())]
        for item, result, (context, arrived) in zip(items, results, arrivals):
            if context is None:
                continue
            attributes = {"specsplit.batch_size": len(items), "specsplit.queue_wait_s": max(0, start - arrived) / 1e9}
            attributes.update(_item_attributes(item, result))
            if self.proposer:
                attributes["specsplit.proposer"] = self.proposer
            for stage, (s, e) in stages.items():
                span = tracer.start_span(stage, context=context, links=back, start_time=s, attributes=attributes)
                if isinstance(result, Exception):
                    span.set_status(Status(StatusCode.ERROR, str(result)))
                span.end(end_time=e)


def _item_attributes(item, result) -> dict:
    attributes = {}
    if hasattr(item, "k"):  # a draft proposal
        attributes["specsplit.k"] = item.k
        if hasattr(result, "token_ids"):
            attributes["specsplit.proposed_tokens"] = len(result.token_ids)
    elif hasattr(item, "draft_token_ids"):  # a target verification
        attributes["specsplit.k"] = len(item.draft_token_ids)
        if hasattr(result, "num_accepted"):
            attributes["specsplit.accepted_tokens"] = result.num_accepted
    elif hasattr(item, "token_ids"):  # a prefill
        attributes["specsplit.prompt_tokens"] = len(item.token_ids)
    return attributes


class _WorkerGauges:
    """Gauges read when scraped: KV blocks, running sequences, queue depth."""

    def __init__(self, telemetry: WorkerTelemetry):
        self.telemetry = telemetry

    def collect(self):
        t = self.telemetry
        if t.proposer:
            kind = GaugeMetricFamily("specsplit_draft_proposer", "The draft's proposer kind (1 for the kind it runs)",
                                     labels=["role", "proposer"])
            kind.add_metric([t.role, t.proposer], 1)
            yield kind
        manager = t.runner.block_manager if t.runner is not None else None
        used, total = (manager.num_used_blocks, manager.num_blocks) if manager is not None else (0, 0)
        for name, help_text, value in (
            ("specsplit_kv_blocks_used", "KV cache blocks in use", used),
            ("specsplit_kv_blocks_total", "KV cache blocks in all", total),
            ("specsplit_kv_blocks_free", "KV cache blocks free", total - used),
            ("specsplit_running_sequences", "Sequences holding KV on this worker", len(t.sequences)),
            ("specsplit_queue_depth", "Items waiting in the worker's batch queue", t.batcher.queue_depth if t.batcher else 0),
        ):
            family = GaugeMetricFamily(name, help_text, labels=["role"])
            family.add_metric([t.role], value)
            yield family
        if t.decode_ahead is not None:
            rows = CounterMetricFamily("specsplit_decode_ahead_rows", "Plain decode rows the target ran ahead "
                                       "(launched), that the next call took (taken), or that it asked something else "
                                       "of (missed)", labels=["role", "outcome"])
            for outcome in ("launched", "taken", "missed"):
                rows.add_metric([t.role, outcome], getattr(t.decode_ahead, outcome))
            yield rows
        cache = manager.prefix_cache if manager is not None else None
        if cache is not None:
            for name, help_text, value in (
                ("specsplit_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", cache.queried_tokens),
                ("specsplit_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix cache", cache.hit_tokens),
                ("specsplit_prefix_cache_evicted_blocks", "Cached prefix blocks taken back for new KV", cache.evicted_blocks),
            ):
                family = CounterMetricFamily(name, help_text, labels=["role"])
                family.add_metric([t.role], value)
                yield family
