"""OpenTelemetry tracing for one process, configured from the standard OTEL_* variables.

Off unless an exporter is asked for: with neither OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT nor OTEL_TRACES_EXPORTER set
(or OTEL_SDK_DISABLED=true, or OTEL_TRACES_EXPORTER=none) `enabled()` is False and callers skip span work
altogether, so tracing that is off costs one boolean test per hook.

- OTEL_TRACES_EXPORTER: `otlp` (the default once an endpoint is set), `console` (JSON to stderr) or `none`.
- OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL (grpc, or
  http/protobuf when that exporter is installed), OTEL_EXPORTER_OTLP_HEADERS, ...: read by the OTLP exporter.
- OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG: read by the SDK (default parentbased_always_on).
- OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES: override the role's default service name (specsplit-<role>).
- OTEL_BSP_*: the batch span processor's queue and delay.
"""

import logging
import os
import sys

log = logging.getLogger(__name__)

_provider = None  # the TracerProvider in use, or None when tracing is off
_tracer = None


def enabled() -> bool:
    return _tracer is not None


def tracer():
    """The process's tracer; only call when `enabled()`."""
    return _tracer


def configure(service_name: str) -> bool:
    """Set up tracing from the environment for a service process; returns whether spans will be exported."""
    try:
        exporter = _exporter_from_env()
    except ImportError as error:  # asked for, but the optional packages are not installed
        log.warning("tracing requested by OTEL_* but unavailable (%s); pip install 'specsplit[observability]'", error)
        return False
    if exporter is None:
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=resource(service_name))  # the sampler comes from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    install(provider)
    return True


def resource(service_name: str):
    """The process's resource: OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES when given, else `service_name`."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    detected = Resource.create()
    if str(detected.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        detected = detected.merge(Resource({SERVICE_NAME: service_name}))
    return detected


def install(provider) -> None:
    """Use this TracerProvider (tests pass one with an in-memory exporter)."""
    global _provider, _tracer
    _provider = provider
    _tracer = provider.get_tracer("specsplit")


def uninstall() -> None:
    global _provider, _tracer
    _provider = _tracer = None


def shutdown() -> None:
    """Flush and stop: spans still queued are exported before the process exits."""
    if _provider is not None:
        _provider.shutdown()
    uninstall()


def _exporter_from_env():
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:
        has_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        names = ["otlp"] if has_endpoint else []
    exporters = [e for e in (_exporter(name) for name in names if name != "none") if e is not None]
    if not exporters:
        return None
    return exporters[0] if len(exporters) == 1 else _Fanout(exporters)


def _exporter(name: str):
    if name == "otlp":
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        if protocol.startswith("http"):
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                log.warning("OTLP over %s needs opentelemetry-exporter-otlp-proto-http; using gRPC", protocol)
            else:
                return OTLPSpanExporter()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        # stderr: a service's stdout is read by whoever started it only until it says it is listening.
        return ConsoleSpanExporter(out=sys.stderr)
    log.warning("unknown OTEL_TRACES_EXPORTER '%s' ignored", name)
    return None


class _Fanout:
    """Several exporters behind one span processor (OTEL_TRACES_EXPORTER=otlp,console)."""

    def __init__(self, exporters):
        self.exporters = exporters

    def export(self, spans):
        results = [e.export(spans) for e in self.exporters]
        return results[0]

    def shutdown(self):
        for e in self.exporters:
            e.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(e.force_flush(timeout_millis) for e in self.exporters)
