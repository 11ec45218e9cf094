"""Observability shared by the three services: OpenTelemetry traces, Prometheus metrics, canary statistics."""
