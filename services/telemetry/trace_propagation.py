"""Trace context across the services.

Public API: a caller's context arrives in the standard headers (W3C `traceparent`/`tracestate`, or whatever
OTEL_PROPAGATORS names): in gRPC metadata, where `CallerContextInterceptor` makes it current while the handler
runs, and in the OpenAI HTTP API's headers, where `caller_context` does; so the request span the coordinator
starts is its child either way.

Worker API: one call carries many sequences, each from another request (another trace), so a single
`traceparent` would misattribute the call to one of them. The coordinator sends instead one W3C traceparent per
sequence inside the request message (`traceparents`, in sequence order; empty when nothing is traced), so the round's
long-lived streams carry them as unary calls do; the worker makes each item's span a child of its own request's span.
"""

import contextvars
from contextlib import contextmanager

import grpc

_outgoing: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("specsplit_outgoing_traceparents",
                                                                              default=None)


def traceparent(span_context) -> str:
    """The W3C traceparent of a span context (sampled flag included)."""
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"


@contextmanager
def sending_item_contexts(span_contexts: list):
    """Worker calls made inside carry these per-item contexts (None = that item is not traced)."""
    token = _outgoing.set([traceparent(c) if c is not None else "" for c in span_contexts])
    try:
        yield
    finally:
        _outgoing.reset(token)


def outgoing_traceparents() -> list[str] | None:
    """The per-item traceparents for a worker call made now, or None outside `sending_item_contexts`."""
    return _outgoing.get()


def item_contexts(traceparents, count: int) -> list:
    """Per-item OpenTelemetry Contexts (None where absent or malformed) from a worker request's traceparents."""
    if len(traceparents) != count:
        return [None] * count
    return [_parse(p) for p in traceparents]


def _parse(value: str):
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if not value:
        return None
    context = TraceContextTextMapPropagator().extract({"traceparent": value})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


@contextmanager
def caller_context(headers):
    """The caller's trace context from HTTP request headers, current inside (case-insensitive names)."""
    from opentelemetry import context as otel_context
    from opentelemetry import propagate

    token = otel_context.attach(propagate.extract({k.lower(): v for k, v in headers.items()}))
    try:
        yield
    finally:
        otel_context.detach(token)


class CallerContextInterceptor(grpc.aio.ServerInterceptor):
    """Makes the caller's trace context (from request metadata) current while a unary or server-streaming
    handler runs."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or (handler.unary_unary is None and handler.unary_stream is None):
            return handler
        from opentelemetry import propagate

        carrier = {}
        for key, value in details.invocation_metadata or ():
            if isinstance(value, str):
                carrier[key.lower()] = value
        parent = propagate.extract(carrier)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, parent), handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_stream_rpc_method_handler(
            _stream(handler.unary_stream, parent), handler.request_deserializer, handler.response_serializer
        )


def _unary(behavior, parent):
    from opentelemetry import context as otel_context

    async def run(request, context):
        token = otel_context.attach(parent)
        try:
            return await behavior(request, context)
        finally:
            otel_context.detach(token)

    return run


def _stream(behavior, parent):
    """The caller's context is attached around each step of the handler, never across a yield: a stream whose
    caller cancels while it waits at a yield is closed later, by the event loop's generator finalizer in another
    task, where a token attached in the handler's task cannot be detached."""
    from opentelemetry import context as otel_context

    async def run(request, context):
        responses = behavior(request, context)
        try:
            while True:
                token = otel_context.attach(parent)
                try:
                    response = await responses.__anext__()
                except StopAsyncIteration:
                    return
                finally:
                    otel_context.detach(token)
                yield response
        finally:
            await responses.aclose()  # the handler's own cleanup (the coordinator aborts the request)

    return run
