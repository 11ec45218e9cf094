"""Tracing configured from the standard OTEL_* variables: off unless an exporter is asked for."""

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specsplit.services.telemetry import tracing

OTEL_VARIABLES = ["OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                  "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
                  "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"]


@pytest.fixture
def env(monkeypatch):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_nothing_set_means_off(env):
    assert tracing._exporter_from_env() is None
    assert tracing.configure("specsplit-test") is False and not tracing.enabled()


@pytest.mark.parametrize("variables, expected", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, OTLPSpanExporter),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, OTLPSpanExporter),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, OTLPSpanExporter),
    ({"OTEL_TRACES_EXPORTER": "console"}, ConsoleSpanExporter),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, None),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, None),
])
def test_exporter_from_the_standard_variables(env, variables, expected):
    for name, value in variables.items():
        env.setenv(name, value)
    exporter = tracing._exporter_from_env()
    assert (exporter is None) if expected is None else isinstance(exporter, expected)
    if exporter is not None:
        exporter.shutdown()


def test_service_name_defaults_to_the_role_and_yields_to_the_environment(env):
    assert tracing.resource("specsplit-draft").attributes["service.name"] == "specsplit-draft"
    env.setenv("OTEL_SERVICE_NAME", "coder-draft-canary")
    env.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging")
    attributes = tracing.resource("specsplit-draft").attributes
    assert attributes["service.name"] == "coder-draft-canary" and attributes["deployment.environment"] == "staging"


def test_the_sampler_comes_from_the_environment(env):
    env.setenv("OTEL_TRACES_SAMPLER", "always_off")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    span = provider.get_tracer("t").start_span("request")
    assert not span.is_recording() and span.get_span_context().is_valid  # context still travels, unsampled
    span.end()
    assert exporter.get_finished_spans() == ()
