"""The coordinator's hooks for traces and call timings: what `Coordinator` calls at submit, at each worker call and
at the end of a request. With tracing off and no metrics attached every hook returns at once.

Trace of one request (the coordinator's side; the workers add their item spans under each call span):

    text_completion <model>                      request span (GenAI conventions), child of the caller's context
      specsplit.v1.TargetWorker/Prefill          one span per worker call per sequence, k / batch size / variant
      specsplit.v1.DraftWorker/Prefill
      specsplit.v1.DraftWorker/Propose           per round
      specsplit.v1.TargetWorker/Verify           per round, with the accepted count
"""

import time
from contextlib import contextmanager

from specsplit.services.telemetry import tracing
from specsplit.services.telemetry.trace_propagation import sending_item_contexts

_RPC = {("target", "prefill"): "TargetWorker/Prefill", ("target", "verify"): "TargetWorker/Verify",
        ("draft", "prefill"): "DraftWorker/Prefill", ("draft", "propose"): "DraftWorker/Propose"}


class CoordinatorTelemetry:
    def __init__(self, coordinator):
        self.coordinator = coordinator
        self.model_name = ""   # gen_ai.request.model; the first target replica's model when left empty
        self.metrics = None    # a CoordinatorMetrics once attached

    def round_chosen(self, k: int, batch: int) -> None:
        """The speculation length the policy chose for a round of `batch` sequences."""
        if self.metrics is not None:
            self.metrics.observe_round(k)

    # ---- the request span -------------------------------------------------------------------------------------

    def request_started(self, sequence) -> None:
        """Start the request's span as a child of the current context (the caller's, over gRPC)."""
        if not tracing.enabled():
            return
        from opentelemetry.trace import SpanKind

        params = sequence.request.params
        model = self.model_name or self._target_model()
        attributes = {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.provider.name": "specsplit",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": sequence.stop.max_tokens,  # unset: what the context leaves
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.top_k": params.top_k,
            "gen_ai.usage.input_tokens": sequence.prompt_len,
            "specsplit.request_id": sequence.request.request_id or sequence.handle,
        }
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        sequence.trace_span = tracing.tracer().start_span(
            f"text_completion {model}".strip(), kind=SpanKind.SERVER, attributes=attributes
        )

    def request_ended(self, sequence) -> None:
        span = sequence.trace_span
        if span is None:
            return
        sequence.trace_span = None
        from opentelemetry.trace import Status, StatusCode

        stats = sequence.stats
        span.set_attributes({
            "gen_ai.response.id": sequence.request.request_id or sequence.handle,
            "gen_ai.response.finish_reasons": [sequence.finish_reason or ""],
            "gen_ai.usage.output_tokens": len(sequence.generated),
            "specsplit.draft_variant": sequence.draft_variant,
            "specsplit.proposer": getattr(sequence.draft, "proposer_kind", "model") if sequence.draft_variant else "none",
            "specsplit.rounds": stats.rounds,
            "specsplit.drafted_tokens": stats.draft_tokens,
            "specsplit.accepted_tokens": stats.accepted_tokens,
            "specsplit.acceptance_method": sequence.acceptance_method,  # "typical" is NOT lossless
        })
        if sequence.first_token_at is not None:
            span.set_attribute("specsplit.time_to_first_token_s", sequence.first_token_at - sequence.started)
        if sequence.error is not None:
            span.record_exception(sequence.error)
            span.set_status(Status(StatusCode.ERROR, str(sequence.error)))
        span.end()

    # ---- worker calls -----------------------------------------------------------------------------------------

    @contextmanager
    def worker_call(self, client, method: str, items: list, sequences: list):
        """Around one batched worker call: a span per sequence (child of its request span) whose context travels
        with its item, and the call's time for the stage-latency histogram. Set `.results` inside."""
        call = _Call()
        spans = self._call_spans(client, method, items, sequences) if tracing.enabled() else None
        start = time.perf_counter()
        try:
            if spans is None:
                yield call
            else:
                with sending_item_contexts([s.get_span_context() if s is not None else None for s in spans]):
                    yield call
        except Exception as error:
            call.results = [error] * len(items)
            raise
        finally:
            if self.metrics is not None:
                self.metrics.observe_call(method, time.perf_counter() - start)
            if spans is not None:
                _end_call_spans(spans, items, call.results)

    def _call_spans(self, client, method, items, sequences) -> list:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        role = "draft" if hasattr(client, "propose") else "target"
        rpc = _RPC[(role, method)]
        service, rpc_method = rpc.split("/")
        tracer = tracing.tracer()
        spans = []
        for item, sequence in zip(items, sequences):
            parent = sequence.trace_span
            if parent is None:
                spans.append(None)
                continue
            attributes = {
                "rpc.system": "grpc", "rpc.service": f"specsplit.v1.{service}", "rpc.method": rpc_method,
                "server.address": getattr(client, "name", ""), "specsplit.batch_size": len(items),
                "specsplit.draft_variant": sequence.draft_variant,
            }
            if role == "draft":  # "model" or "ngram" (prompt lookup)
                attributes["specsplit.proposer"] = getattr(client, "proposer_kind", "model")
            k = getattr(item, "k", None)
            if k is None and hasattr(item, "draft_token_ids"):
                k = len(item.draft_token_ids)
            if k is not None:
                attributes["specsplit.k"] = k
            spans.append(tracer.start_span(
                f"specsplit.v1.{rpc}", context=trace.set_span_in_context(parent), kind=SpanKind.CLIENT, attributes=attributes
            ))
        return spans

    def _target_model(self) -> str:
        for replica in self.coordinator.targets.replicas:
            info = getattr(replica, "info", None)
            if info is not None and getattr(info, "model", ""):
                return info.model
            verifier = getattr(replica, "verifier", None)
            if verifier is not None:
                return verifier.runner.loaded.name
        return ""


class _Call:
    results: list | None = None


def _end_call_spans(spans, items, results) -> None:
    from opentelemetry.trace import Status, StatusCode

    for i, span in enumerate(spans):
        if span is None:
            continue
        result = results[i] if results is not None and i < len(results) else None
        if isinstance(result, Exception):
            span.set_status(Status(StatusCode.ERROR, str(result)))
        elif hasattr(result, "num_accepted"):
            span.set_attribute("specsplit.accepted_tokens", result.num_accepted)
            span.set_attribute("specsplit.emitted_tokens", len(result.token_ids))
        elif hasattr(result, "token_ids"):
            span.set_attribute("specsplit.proposed_tokens", len(result.token_ids))
        span.end()
