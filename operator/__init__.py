"""Kubernetes operator for SpeculativeDeployment (kopf)."""
