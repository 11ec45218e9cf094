"""Request spans from the coordinator, in-process with the SDK's in-memory exporter: structure and GenAI
attributes, per-item context handed to worker calls, the caller's context over gRPC (unary, and a stream the
caller cancels), failures, and nothing at all when tracing is off."""

import asyncio
import logging

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from specsplit.proto.v1 import generation_pb2_grpc
from specsplit.services.coordinator import public_messages as pm
from specsplit.services.coordinator.server import GenerationService
from specsplit.services.errors import InvalidArgument
from specsplit.services.local_engine import LocalEngine
from specsplit.services.rpc.server import start_server
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.telemetry import tracing
from specsplit.services.telemetry.trace_propagation import CallerContextInterceptor, outgoing_traceparents, traceparent


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.uninstall()


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=3, dtype="float64", num_kv_blocks=256)


class RecordingDraft:
    """The real in-process draft client, noting the per-item trace context each call would send."""

    def __init__(self, inner):
        self.inner, self.name, self.sent = inner, inner.name, []
        self.vocab_size, self.max_model_len = inner.vocab_size, inner.max_model_len

    async def prefill(self, items):
        self.sent.append(outgoing_traceparents())
        return await self.inner.prefill(items)

    async def propose(self, items):
        self.sent.append(outgoing_traceparents())
        return await self.inner.propose(items)

    async def release(self, handles):
        return await self.inner.release(handles)


def generate(engine, prompt, **params):
    async def main():
        result = await engine.generate(prompt, SamplingParams(**params))
        await engine.coordinator.wait_idle()
        return result

    return asyncio.run(main())


def test_request_span_and_its_worker_calls(engine, spans):
    pool = engine.coordinator.drafts[0]
    recording = RecordingDraft(pool.replicas[0])
    pool.replicas[0] = recording
    try:
        result = generate(engine, "def add(a, b):", max_tokens=12, ignore_eos=True, temperature=0.0)
    finally:
        pool.replicas[0] = recording.inner
    finished = spans.get_finished_spans()
    (request,) = [s for s in finished if s.name.startswith("text_completion")]
    assert request.name == "text_completion target" and request.kind == SpanKind.SERVER
    a = request.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "target"
    assert a["gen_ai.request.max_tokens"] == 12 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == len("def add(a, b):") and a["gen_ai.usage.output_tokens"] == 12
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["gen_ai.response.id"] == result.request_id
    assert a["specsplit.draft_variant"] == "default" and a["specsplit.rounds"] == result.stats.rounds
    assert a["specsplit.acceptance_method"] == result.acceptance_method == "rejection"
    children = [s for s in finished if s.parent is not None and s.parent.span_id == request.context.span_id]
    assert len(children) == len(finished) - 1  # everything else hangs off the request
    assert all(s.context.trace_id == request.context.trace_id and s.kind == SpanKind.CLIENT for s in children)
    proposes = [s for s in children if s.name == "specsplit.v1.DraftWorker/Propose"]
    verifies = [s for s in children if s.name == "specsplit.v1.TargetWorker/Verify"]
    assert len(verifies) == result.stats.rounds and len(proposes) >= 1
    assert sum(s.attributes["specsplit.accepted_tokens"] for s in verifies) == result.stats.accepted_tokens
    assert sum(s.attributes["specsplit.proposed_tokens"] for s in proposes) == result.stats.draft_tokens
    assert all(s.attributes["specsplit.k"] <= 3 and s.attributes["specsplit.batch_size"] == 1 for s in proposes)
    # Each draft call carried the W3C context of its own span for its one item.
    draft_calls = sorted((s for s in children if s.name.startswith("specsplit.v1.DraftWorker/")), key=lambda s: s.start_time)
    assert [m[0] for m in recording.sent] == [traceparent(s.context) for s in draft_calls]
    assert outgoing_traceparents() is None  # nothing leaks outside the call


def test_caller_context_is_the_parent_and_a_failure_marks_the_span(engine, spans):
    caller = TracerProvider().get_tracer("caller")  # a caller with its own (unexported) tracing
    target = engine.coordinator.targets.replicas[0]

    async def main():
        with caller.start_as_current_span("caller") as parent:
            await engine.generate("hello", SamplingParams(max_tokens=4))
        original = target.verify

        async def broken(items):  # stands in for a target that rejects the request's items
            return [InvalidArgument("token ids out of range")] * len(items)

        target.verify = broken
        try:
            with pytest.raises(InvalidArgument):
                await engine.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True))
        finally:
            target.verify = original
        await engine.coordinator.wait_idle()
        return parent

    parent = asyncio.run(main())
    ok, failed = [s for s in spans.get_finished_spans() if s.name.startswith("text_completion")]
    assert ok.parent.span_id == parent.get_span_context().span_id
    assert ok.context.trace_id == parent.get_span_context().trace_id
    assert failed.parent is None and failed.status.status_code == StatusCode.ERROR
    assert failed.attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert any(e.name == "exception" for e in failed.events)


def test_caller_context_over_grpc_and_a_cancelled_stream(engine, spans, caplog):
    caller = TracerProvider().get_tracer("caller")

    async def main():
        server, port, _ = await start_server(
            GenerationService(engine.coordinator).add_to, ["specsplit.v1.Generation"], "127.0.0.1", 0,
            [CallerContextInterceptor()],
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                with caller.start_as_current_span("unary") as unary:
                    metadata = (("traceparent", traceparent(unary.get_span_context())),)
                    await stub.Generate(pm.request_pb("hi", SamplingParams(max_tokens=4), False, ""), metadata=metadata)
                with caller.start_as_current_span("stream") as streamed:
                    metadata = (("traceparent", traceparent(streamed.get_span_context())),)
                    call = stub.GenerateStream(
                        pm.request_pb("hi", SamplingParams(max_tokens=200, ignore_eos=True), False, ""), metadata=metadata
                    )
                    async for _ in call:
                        call.cancel()  # the caller leaves after the first chunk
                        break
            for _ in range(100):
                if len([s for s in spans.get_finished_spans() if s.name.startswith("text_completion")]) == 2:
                    break
                await asyncio.sleep(0.05)
            await engine.coordinator.wait_idle()
        finally:
            await server.stop(None)
        return unary, streamed

    with caplog.at_level(logging.ERROR, logger="opentelemetry.context"):
        unary, streamed = asyncio.run(main())
    assert not [r for r in caplog.records if "detach" in r.getMessage().lower()]
    requests = {s.parent.span_id: s for s in spans.get_finished_spans() if s.name.startswith("text_completion")}
    assert set(requests) == {unary.get_span_context().span_id, streamed.get_span_context().span_id}
    assert requests[streamed.get_span_context().span_id].attributes["gen_ai.response.finish_reasons"] == ("abort",)


def test_tracing_off_makes_no_spans_and_sends_no_context(engine):
    assert not tracing.enabled()
    pool = engine.coordinator.drafts[0]
    recording = RecordingDraft(pool.replicas[0])
    pool.replicas[0] = recording

    async def main():
        # A fixed k: the draft is called whatever the policy has learnt of this tiny pair by now.
        params = SamplingParams(max_tokens=6, ignore_eos=True, num_speculative_tokens=2, speculation="fixed")
        sequence = engine.coordinator.submit(engine.request("abc", params))
        while not sequence.finished:
            assert sequence.trace_span is None
            await asyncio.sleep(0.01)
        await engine.coordinator.wait_idle()

    try:
        asyncio.run(main())
    finally:
        pool.replicas[0] = recording.inner
    assert recording.sent and all(m is None for m in recording.sent)
