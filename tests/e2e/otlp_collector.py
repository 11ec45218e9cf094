"""A minimal OpenTelemetry collector for tests: the real OTLP/gRPC TraceService on loopback, keeping every span
the services export (over the same protocol a production collector receives)."""

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class CollectedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str          # "" for a root span
    kind: int
    attributes: dict
    links: tuple                 # ((trace_id, span_id), ...)
    start_ns: int
    end_ns: int
    status_code: int


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink):
        self.sink = sink

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.sink(CollectedSpan(
                        service=resource.get("service.name", ""),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        kind=s.kind,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        status_code=s.status.code,
                    ))
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpCollector:
    def __init__(self):
        self._spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self._add), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _add(self, span: CollectedSpan) -> None:
        with self._lock:
            self._spans.append(span)

    def spans(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate, timeout: float = 20.0) -> list[CollectedSpan]:
        """Poll until predicate(spans) holds (services export in batches); returns the spans then."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans did not arrive in {timeout}s; got {sorted({(s.service, s.name) for s in spans})}")
            time.sleep(0.1)

    def stop(self) -> None:
        self._server.stop(grace=None)
