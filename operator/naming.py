"""Names shared by the CRD, the manifests and the handlers: one place to read them from."""

GROUP = "specsplit.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "SpeculativeDeployment"
PLURAL = "speculativedeployments"
SINGULAR = "speculativedeployment"
SHORT_NAME = "specdeploy"

# Components: one Deployment each; the first three always exist, the canary only during a rollout.
COORDINATOR = "coordinator"
TARGET = "target"
DRAFT = "draft"
DRAFT_CANARY = "draft-canary"
ROLES = (TARGET, DRAFT)  # the two autoscaled pools

# Recommended labels (https://kubernetes.io/docs/concepts/overview/working-with-objects/common-labels/).
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
APP = "specsplit"
MANAGER = "specsplit-operator"

# What the operator last wrote to an object, so it can patch minimally and tell its own writes from others'.
ANNOTATION_LAST_APPLIED = "specsplit.dev/last-applied"

# Ports fixed by the services' contract.
GRPC_PORT = 50051
ROUND_PORT = 50061  # a worker's round channel: the round's calls and prefills as frames beside gRPC (Describe advertises it)
HTTP_PORT = 8000  # the coordinator's OpenAI-compatible HTTP API
METRICS_PORT = 9090
# The co-located mode (spec.coordinator.colocated): the coordinator runs in every target pod, beside the target's
# own gRPC (50051) and metrics (9090) ports, on ports (and container port names) of its own.
COLOCATED_GRPC_PORT = 50050
COLOCATED_METRICS_PORT = 9091
COLOCATED_GRPC_PORT_NAME = "coord-grpc"
COLOCATED_METRICS_PORT_NAME = "coord-metrics"
# The HTTP ports the operator scrapes, by container port name.
SCRAPED_PORTS = {"metrics": METRICS_PORT, COLOCATED_METRICS_PORT_NAME: COLOCATED_METRICS_PORT}

# The coordinator reads its draft variants from this file (a ConfigMap key mounted read-only). Each mount
# under /etc/specsplit is its own folder: a volume mounted inside a ConfigMap's volume would be disturbed
# whenever the ConfigMap (rewritten at every canary step) is updated.
VARIANTS_KEY = "draft-variants.json"
CONFIG_DIR = "/etc/specsplit/config"
MODEL_CACHE_DIR = "/models"

# TLS of the internal gRPC (a kubernetes.io/tls Secret with ca.crt), in the coordinator and every worker.
TLS_DIR = "/etc/specsplit/tls"
TLS_CERT_KEY, TLS_KEY_KEY, TLS_CA_KEY = "tls.crt", "tls.key", "ca.crt"
# TLS of the coordinator's public port (tls.crt, tls.key), and the bearer tokens its clients must send.
PUBLIC_TLS_DIR = "/etc/specsplit/public-tls"
AUTH_DIR = "/etc/specsplit/auth"
# The workers' shared secret (key `secret`), in the coordinator and every worker (services/rpc/worker_credentials.py).
WORKER_AUTH_DIR = "/etc/specsplit/worker-auth"
WORKER_AUTH_KEY = "secret"
AUTH_TOKENS_KEY = "tokens"

# Names of the draft variants in the coordinator's variants file and its /v1/canary report.
STABLE_VARIANT = "stable"
CANARY_VARIANT = "canary"


def component_name(instance: str, component: str) -> str:
    """Name of a component's Deployment (and headless Service): e.g. `coder-target`."""
    return f"{instance}-{component}"


def coordinator_service_name(instance: str) -> str:
    """The public entry point carries the resource's own name."""
    return instance


def config_map_name(instance: str) -> str:
    return f"{instance}-{COORDINATOR}"


def labels(instance: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: APP,
        LABEL_INSTANCE: instance,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGER,
    }


def selector(instance: str, component: str) -> dict[str, str]:
    """Pod selector of a component: immutable in a Deployment, so it never includes anything that may change."""
    return {LABEL_NAME: APP, LABEL_INSTANCE: instance, LABEL_COMPONENT: component}


def selector_string(instance: str, component: str) -> str:
    return ",".join(f"{key}={value}" for key, value in selector(instance, component).items())
