"""What a service process starts for observability (tracing from OTEL_*, the metrics port) and stops at exit."""

import logging

from specsplit.services.telemetry import tracing
from specsplit.services.telemetry.metrics_server import start_metrics_server

log = logging.getLogger(__name__)


class ServiceObservability:
    def __init__(self, role: str, registry, host: str, metrics_port: int | None, json_routes: dict | None = None):
        self.role = role
        self.tracing = tracing.configure(f"specsplit-{role}")
        try:
            self.metrics_server = start_metrics_server(role, registry, host, metrics_port, json_routes)
        except OSError as error:  # a busy port costs the metrics, not the service
            log.warning("metrics for %s not served on %s:%s: %s", role, host, metrics_port, error)
            self.metrics_server = None

    @property
    def interceptors(self) -> list:
        """Server interceptors for the public API: the caller's trace context becomes the request's parent."""
        if not self.tracing:
            return []
        from specsplit.services.telemetry.trace_propagation import CallerContextInterceptor

        return [CallerContextInterceptor()]

    def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
        tracing.shutdown()  # flushes spans still queued


def observe_worker(role: str, service, host: str, metrics_port: int | None) -> ServiceObservability:
    return ServiceObservability(role, service.telemetry.registry, host, metrics_port)


def observe_coordinator(coordinator, model_name: str, host: str, metrics_port: int | None) -> ServiceObservability:
    """Metrics, canary statistics (/v1/canary) and request spans of a coordinator; `.canary` feeds
    GetDraftVariantStats."""
    from specsplit.services.telemetry.coordinator_metrics import CoordinatorMetrics

    coordinator.telemetry.model_name = model_name
    metrics = CoordinatorMetrics(coordinator).attach()
    observability = ServiceObservability(
        "coordinator", metrics.registry, host, metrics_port, {"/v1/canary": metrics.canary.report}
    )
    observability.canary = metrics.canary
    observability.metrics = metrics
    return observability
