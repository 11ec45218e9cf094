"""Entry point of `kopf run`: registers the handlers in kopf's default registry.

The operator's Deployment runs (see OPERATOR_COMMAND):
    kopf run --module specsplit.operator.main --all-namespaces --liveness=http://0.0.0.0:8080/healthz
Peering (leader election between replicas) is switched on in the startup handler with the name
`specsplit` (see settings.py); a ClusterKopfPeering of that name must exist (operator/crd/kopf-peering.yaml
has its CRD; the chart creates the object). Knobs come from SPECSPLIT_OPERATOR_* environment variables.
"""

import kopf

from specsplit.operator.handlers import register
from specsplit.operator.settings import OperatorConfig

OPERATOR_COMMAND = [
    "kopf", "run",
    "--module", "specsplit.operator.main",
    "--all-namespaces",
    "--liveness=http://0.0.0.0:8080/healthz",
]

register(kopf.get_default_registry(), OperatorConfig.from_env())
