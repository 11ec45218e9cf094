"""A worker's step telemetry, in-process on real (tiny) models: two requests in one batched call get item spans
under their own request contexts (prefill / propose on the draft; prefill / score / verify on the target), one
step span linking to both, and stage latencies in /metrics."""

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specsplit.services.draft.proposer import DraftPrefill, ProposeItem
from specsplit.services.rpc import worker_messages as msg
from specsplit.services.rpc.worker_process import build_worker_service
from specsplit.services.runtime.worker_sequences import WorkerSampling
from specsplit.services.target.verifier import TargetPrefill, VerifyItem
from specsplit.services.telemetry import tracing
from specsplit.services.telemetry.trace_propagation import traceparent


class CallContext:
    """Stands in for grpc's ServicerContext: the servicer reads only the call's metadata."""

    def __init__(self, metadata):
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter, provider.get_tracer("coordinator-side")
    tracing.uninstall()


def stage_counts(registry) -> dict:
    return {s.labels["stage"]: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples if s.name == "specsplit_stage_latency_seconds_count"}


def test_batched_steps_are_attributed_to_each_request(tiny_pair, spans):
    exporter, coordinator_side = spans
    draft, _ = build_worker_service("draft", str(tiny_pair["close"]), dtype="float64", num_kv_blocks=64)
    target, _ = build_worker_service("target", str(tiny_pair["target"]), dtype="float64", num_kv_blocks=64)
    greedy = WorkerSampling(0.0, 0, 1.0, 1)
    prompts = {"r1": [1, 2, 3, 4], "r2": [9, 8, 7]}
    requests = {h: coordinator_side.start_span(f"request {h}") for h in prompts}

    def call(method, build, items):
        """One call carrying both requests' items, each with the context of a coordinator-side span under its
        request (in the message, as the coordinator sends them); returns (response, those spans)."""
        parents = [coordinator_side.start_span(method.__name__, trace.set_span_in_context(requests[h])) for h in prompts]
        request = build(items, [traceparent(p.get_span_context()) for p in parents])
        response = asyncio.run(method(request, CallContext(())))
        for p in parents:
            p.end()
        return response, parents

    items = [TargetPrefill(h, p, greedy) for h, p in prompts.items()]
    first = msg.verdicts(call(target.Prefill, msg.target_prefill_request, items)[0], [False, False])
    call(draft.Prefill, msg.draft_prefill_request, [DraftPrefill(h, p, greedy) for h, p in prompts.items()])
    propose_items = [ProposeItem(h, len(p), [v.token_ids[0]], 3) for (h, p), v in zip(prompts.items(), first)]
    proposals = msg.proposals(call(draft.Propose, msg.propose_request, propose_items)[0])
    verify_items = [
        VerifyItem(h, len(p), [v.token_ids[0]], proposal.token_ids, proposal.q_token_ids, proposal.q_probs)
        for (h, p), v, proposal in zip(prompts.items(), first, proposals)
    ]
    response, verify_parents = call(target.Verify, msg.verify_request, verify_items)
    verdicts = msg.verdicts(response, [False, False])
    for span in requests.values():
        span.end()

    finished = exporter.get_finished_spans()
    by_parent = {}
    for s in finished:
        if s.parent is not None:
            by_parent.setdefault(s.parent.span_id, []).append(s)
    for parent, verdict in zip(verify_parents, verdicts):
        children = {s.name: s for s in by_parent[parent.get_span_context().span_id]}
        assert set(children) == {"score", "verify"}  # the target forward, then acceptance
        score, accept = children["score"], children["verify"]
        assert score.context.trace_id == parent.get_span_context().trace_id
        assert score.end_time <= accept.start_time
        assert accept.attributes["specsplit.accepted_tokens"] == verdict.num_accepted
        assert accept.attributes["specsplit.k"] == 3 and accept.attributes["specsplit.batch_size"] == 2
    steps = [s for s in finished if s.name in ("draft.step", "target.step")]
    assert sorted(s.attributes["specsplit.step.kind"] for s in steps) == ["prefill", "prefill", "propose", "verify"]
    for step in steps:
        assert step.parent is None and len(step.links) == 2
        assert {link.context.trace_id for link in step.links} == {r.get_span_context().trace_id for r in requests.values()}
    item_spans = [s for s in finished if s.name in ("prefill", "propose", "score", "verify") and s.links]
    assert len(item_spans) == 2 * 5 and all(s.links[0].context.span_id in {t.context.span_id for t in steps} for s in item_spans)
    assert stage_counts(target.telemetry.registry) == {"prefill": 1, "score": 1, "verify": 1}
    assert stage_counts(draft.telemetry.registry) == {"prefill": 1, "propose": 1}
    target.batcher.stop()
    draft.batcher.stop()


def test_requests_left_out_by_the_sampler_get_no_worker_spans(tiny_pair, spans):
    exporter, _ = spans
    target, _ = build_worker_service("target", str(tiny_pair["target"]), dtype="float64", num_kv_blocks=64)
    unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    request = msg.target_prefill_request([TargetPrefill("r", [1, 2, 3], WorkerSampling(0.0, 0, 1.0, 1))], [unsampled])
    asyncio.run(target.Prefill(request, CallContext(())))
    target.batcher.stop()
    assert exporter.get_finished_spans() == ()
    assert stage_counts(target.telemetry.registry)["prefill"] == 1  # metrics are kept all the same
