"""SpeculativeDeployment spec: validation and defaults, as a pure function from the raw spec to typed values.

The CRD's structural schema already rejects wrong types and out-of-range numbers at the API server; this
module repeats those checks (the operator must not trust that every cluster validates the same way), adds
the rules a schema cannot say well (min <= max, canary weight within its maximum, GPUs cover the
tensor-parallel shards) and fills the same defaults as the CRD, so the handlers work on complete values.
Every error names the field it is about, so the status condition tells the user what to fix.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from specsplit.operator.draft_source import (DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, PROPOSERS, is_ngram,
                                             ngram_source)

TARGET_METRICS = ("kvUtilization", "verifyQueueDepth")
DRAFT_METRICS = ("proposeQueueDepth", "proposeLatencySeconds")
PROMOTION_METRICS = ("tokensPerSecond", "acceptanceRate")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
DECODE_AHEAD_MODES = ("auto", "on", "off")  # the target's --decode-ahead (services/target/decode_ahead.py; no torch here)

# Every owned Service is named NAME-component; a Service name is a DNS-1035 label of at most 63 characters,
# and the longest suffix is "-draft-canary".
MAX_NAME_LENGTH = 63 - len("-draft-canary")
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# Names of Secrets (DNS-1123 subdomains), host names to check in certificates, environment variable names
# (as Kubernetes 1.30 accepts them).
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
HOST_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")

# core/v1 Affinity: the kinds, and the scheduling terms each kind takes (an object for the node's required
# term, lists otherwise). Deeper than this the API server checks the Deployment the operator writes.
AFFINITY_TERMS = {
    "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": dict,
                     "preferredDuringSchedulingIgnoredDuringExecution": list},
    "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": list,
                    "preferredDuringSchedulingIgnoredDuringExecution": list},
    "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": list,
                        "preferredDuringSchedulingIgnoredDuringExecution": list},
}
# core/v1 EnvVarSource: exactly one source, each with the key it cannot do without.
ENV_SOURCES = {"fieldRef": ("fieldPath", ("apiVersion", "fieldPath")),
               "resourceFieldRef": ("resource", ("containerName", "resource", "divisor")),
               "configMapKeyRef": ("key", ("name", "key", "optional")),
               "secretKeyRef": ("key", ("name", "key", "optional"))}

DEFAULT_K = 4
# A draft's or canary's `model` field holds what its pool runs: a model name, or the n-gram proposer as
# `ngram:MAX:MIN` (draft_source.py), so rollouts compare and record either the same way.
DEFAULT_TARGET_METRICS = {"kvUtilization": 0.8, "verifyQueueDepth": 4.0}
DEFAULT_DRAFT_METRICS = {"proposeQueueDepth": 4.0}


class InvalidSpecError(ValueError):
    """The spec cannot be turned into objects; `errors` lists every problem found, each naming its field."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


@dataclasses.dataclass(frozen=True)
class Replicas:
    min: int
    max: int


@dataclasses.dataclass(frozen=True)
class Resources:
    requests: Mapping[str, str]
    limits: Mapping[str, str]
    gpus: int  # becomes nvidia.com/gpu in both requests and limits


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    model: str
    replicas: Replicas
    resources: Resources
    tensor_parallel_size: int
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any]  # a core/v1 Affinity, as given
    env: tuple[Mapping[str, Any], ...]  # core/v1 EnvVars added to (or replacing) the operator's own
    metric_targets: Mapping[str, float]  # autoscaling targets, keyed by the CRD's metric names
    decode_ahead: str = "auto"  # target only: --decode-ahead (auto = on where the target is on a GPU)


@dataclasses.dataclass(frozen=True)
class CoordinatorSpec:
    replicas: int
    resources: Resources
    port: int  # port of the public Service; the container listens on 50051 (co-located: 50050, naming.py)
    http_port: int  # the Service's port for the OpenAI-compatible HTTP API (the container's is 8000); 0 = none
    tls_secret_name: str | None  # TLS on the public port: a Secret with tls.crt and tls.key
    auth_token_secret_name: str | None  # bearer tokens clients must send: a Secret with key `tokens`
    # In every target pod (`specsplit target --coordinate`) instead of a Deployment of its own: one hop per round;
    # the public API then has the target pool's replicas and the target container's resources.
    colocated: bool = False
    # An idle coordinator's first prefill waits up to this long for a burst's requests (--arrival-window-ms); 0 = off.
    arrival_window_ms: float = 0.0
    # Sequences decoding at once and requests waiting for a place (--max-num-seqs, --max-waiting); None: the
    # coordinator's defaults.
    max_num_seqs: int | None = None
    max_waiting: int | None = None


@dataclasses.dataclass(frozen=True)
class InternalTLS:
    """TLS between the coordinator and the workers, from one kubernetes.io/tls Secret that also holds ca.crt."""
    secret_name: str
    mutual: bool  # workers require the coordinator's client certificate
    server_name: str | None  # the name the coordinator checks in workers' certificates; None: the Service's


@dataclasses.dataclass(frozen=True)
class PromotionPolicy:
    metric: str
    confidence: float
    min_requests: int
    step_percent: int
    max_weight: int
    interval_seconds: float


@dataclasses.dataclass(frozen=True)
class CanarySpec:
    model: str
    weight: int
    replicas: int
    promotion: PromotionPolicy


@dataclasses.dataclass(frozen=True)
class AutoscalingSpec:
    scale_down_window_seconds: float
    scale_up_window_seconds: float
    scale_down_cooldown_seconds: float
    max_step: int
    interval_seconds: float


@dataclasses.dataclass(frozen=True)
class DeploymentSpec:
    image: str
    image_pull_policy: str | None
    image_pull_secrets: tuple[str, ...]  # Secret names, for every pod
    num_speculative_tokens: int
    target: RoleSpec
    draft: RoleSpec
    coordinator: CoordinatorSpec
    canary: CanarySpec | None
    autoscaling: AutoscalingSpec
    model_cache_claim: str | None
    model_cache_size_limit: str | None
    otlp_endpoint: str | None
    tls: InternalTLS | None
    # A Secret whose key `secret` every worker call must carry; None: workers are admitted by mutual TLS, or
    # (neither set) run with --allow-unauthenticated behind their NetworkPolicy. The Helm chart always sets one.
    worker_auth_secret_name: str | None = None
    # Workers run --batch-invariant: greedy output bit-exact to the target alone at any batch (needs unsharded pools).
    batch_invariant: bool = False


_REQUIRED = object()


class _Fields:
    """Reads one object of the raw spec, collecting errors instead of stopping at the first."""

    def __init__(self, raw: Any, path: str, errors: list[str]) -> None:
        self.path, self.errors = path, errors
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            errors.append(f"{path}: must be an object")
            raw = {}
        self.raw = raw

    def _get(self, key: str, default: Any) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is _REQUIRED:
            self.errors.append(f"{self.path}.{key}: required")
        return default

    def string(self, key: str, default: Any = _REQUIRED, choices: tuple[str, ...] = ()) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if not isinstance(value, str) or not value.strip():
            self.errors.append(f"{self.path}.{key}: must be a non-empty string")
            return default if default is not _REQUIRED else ""
        if choices and value not in choices:
            self.errors.append(f"{self.path}.{key}: {value!r} is not one of {', '.join(choices)}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            self.errors.append(f"{self.path}.{key}: must be true or false")
            return default
        return value

    def name(self, key: str, default: Any = _REQUIRED, pattern: re.Pattern[str] = DNS_1123_SUBDOMAIN,
             what: str = "a lowercase DNS name (a Secret's name)") -> Any:
        """A string that names a Kubernetes object (or a host): checked here, as a pod with a bad one never starts."""
        value = self.string(key, default)
        if isinstance(value, str) and value and (len(value) > 253 or not pattern.match(value)):
            self.errors.append(f"{self.path}.{key}: {value!r} must be {what} of at most 253 characters")
        return value

    def integer(self, key: str, default: Any = _REQUIRED, low: int | None = None, high: int | None = None) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            self.errors.append(f"{self.path}.{key}: must be an integer")
            return default if default is not _REQUIRED else 0
        self._range(key, value, low, high)
        return value

    def number(self, key: str, default: Any = _REQUIRED, low: float | None = None, high: float | None = None,
               exclusive_low: bool = False) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.errors.append(f"{self.path}.{key}: must be a number")
            return default if default is not _REQUIRED else 0.0
        if exclusive_low and low is not None and value <= low:
            self.errors.append(f"{self.path}.{key}: must be greater than {low}, got {value}")
        else:
            self._range(key, value, None if exclusive_low else low, high)
        return float(value)

    def _range(self, key: str, value: float, low: float | None, high: float | None) -> None:
        if low is not None and value < low:
            self.errors.append(f"{self.path}.{key}: must be at least {low}, got {value}")
        if high is not None and value > high:
            self.errors.append(f"{self.path}.{key}: must be at most {high}, got {value}")

    def string_map(self, key: str) -> dict[str, str]:
        value = self._get(key, {})
        if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
            self.errors.append(f"{self.path}.{key}: must be a map of strings")
            return {}
        return dict(value)

    def quantity_map(self, key: str) -> dict[str, str]:
        value = self._get(key, {})
        if not isinstance(value, Mapping) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                                     for v in value.values()):
            self.errors.append(f"{self.path}.{key}: must be a map of resource quantities")
            return {}
        return {name: str(quantity) for name, quantity in value.items()}

    def object_list(self, key: str) -> tuple[Mapping[str, Any], ...]:
        value = self._get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
            self.errors.append(f"{self.path}.{key}: must be a list of objects")
            return ()
        return tuple(dict(item) for item in value)

    def child(self, key: str) -> _Fields:
        return _Fields(self.raw.get(key), f"{self.path}.{key}", self.errors)

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def only(self, *known: str) -> None:
        for key in self.raw:
            if key not in known:
                self.errors.append(f"{self.path}.{key}: unknown field (known: {', '.join(known)})")


def _resources(fields: _Fields, default_gpus: int, allow_gpus: bool = True) -> Resources:
    fields.only("requests", "limits", *(["gpus"] if allow_gpus else []))
    gpus = fields.integer("gpus", default_gpus, low=0, high=16) if allow_gpus else 0
    requests, limits = fields.quantity_map("requests"), fields.quantity_map("limits")
    for name, quantities in (("requests", requests), ("limits", limits)):
        if "nvidia.com/gpu" in quantities:
            fields.errors.append(f"{fields.path}.{name}: set GPUs with {fields.path}.gpus, not nvidia.com/gpu")
    return Resources(requests=requests, limits=limits, gpus=gpus)


def _affinity(fields: _Fields) -> dict[str, Any]:
    """A core/v1 Affinity: its kinds and their terms by name and shape; the terms themselves as given."""
    fields.only(*AFFINITY_TERMS)
    for kind, terms in AFFINITY_TERMS.items():
        kind_fields = fields.child(kind)
        kind_fields.only(*terms)
        for term, shape in terms.items():
            value = kind_fields.raw.get(term)
            if value is None:
                continue
            if shape is dict and not isinstance(value, Mapping):
                fields.errors.append(f"{kind_fields.path}.{term}: must be an object")
            if shape is list and not (isinstance(value, list) and all(isinstance(item, Mapping) for item in value)):
                fields.errors.append(f"{kind_fields.path}.{term}: must be a list of objects")
    return copy.deepcopy(dict(fields.raw))


def _env(fields: _Fields, key: str) -> tuple[dict[str, Any], ...]:
    """core/v1 EnvVars: a name, and a value or one valueFrom source; no name twice."""
    raw = fields.raw.get(key)
    if raw is None:
        return ()
    if not isinstance(raw, list):
        fields.errors.append(f"{fields.path}.{key}: must be a list of objects")
        return ()
    seen: set[str] = set()
    for index, item in enumerate(raw):
        variable = _Fields(item, f"{fields.path}.{key}[{index}]", fields.errors)
        variable.only("name", "value", "valueFrom")
        name = variable.name("name", pattern=ENV_NAME, what="an environment variable name (letters, digits, "
                             "'-', '.', '_', not starting with a digit)")
        if isinstance(name, str) and name and name in seen:
            fields.errors.append(f"{variable.path}.name: {name!r} is set twice")
        seen.add(name)
        if "value" in variable.raw and not isinstance(variable.raw["value"], str):
            fields.errors.append(f"{variable.path}.value: must be a string")
        if variable.has("valueFrom"):
            if variable.has("value"):
                fields.errors.append(f"{variable.path}: set value or valueFrom, not both")
            source = variable.child("valueFrom")
            source.only(*ENV_SOURCES)
            chosen = [kind for kind in ENV_SOURCES if source.has(kind)]
            if len(chosen) != 1:
                fields.errors.append(f"{source.path}: must have exactly one of {', '.join(ENV_SOURCES)}")
            for kind in chosen:
                required, known = ENV_SOURCES[kind]
                reference = source.child(kind)
                reference.only(*known)
                reference.string(required)
    return tuple(copy.deepcopy(dict(item)) for item in raw if isinstance(item, Mapping))


def _draft_source(fields: _Fields) -> str:
    """A draft or canary's `model`, or with `proposer: ngram` the n-gram proposer (draft_source.py): no model."""
    proposer = fields.string("proposer", "model", choices=PROPOSERS)
    if proposer != "ngram":
        if fields.has("ngram"):
            fields.errors.append(f"{fields.path}.ngram: only with proposer: ngram")
        return fields.string("model")
    if fields.has("model"):
        fields.errors.append(f"{fields.path}.model: the n-gram proposer runs no model; leave it out")
    sizes = fields.child("ngram")
    sizes.only("max", "min")
    most = sizes.integer("max", DEFAULT_NGRAM_MAX, low=1, high=64)
    fewest = sizes.integer("min", DEFAULT_NGRAM_MIN, low=1, high=64)
    if fewest > most:
        fields.errors.append(f"{sizes.path}: min ({fewest}) must not exceed max ({most})")
    return ngram_source(most, fewest)


def _role(fields: _Fields, role: str, metrics: tuple[str, ...], default_targets: Mapping[str, float]) -> RoleSpec:
    fields.only("model", "replicas", "resources", "tensorParallelSize", "nodeSelector", "tolerations", "affinity",
                "env", "autoscaling", *(("proposer", "ngram") if role == "draft" else ("decodeAhead",)))
    model = _draft_source(fields) if role == "draft" else fields.string("model")
    replicas_fields = fields.child("replicas")
    replicas_fields.only("min", "max")
    fewest = replicas_fields.integer("min", 1, low=1, high=1000)
    most = replicas_fields.integer("max", fewest, low=1, high=1000)
    if fewest > most:
        fields.errors.append(f"{fields.path}.replicas: min ({fewest}) must not exceed max ({most})")
    tp = fields.integer("tensorParallelSize", 1, low=1, high=16)
    if is_ngram(model) and tp != 1:
        fields.errors.append(f"{fields.path}.tensorParallelSize: the n-gram proposer has no model to shard; must be 1")
    resources = _resources(fields.child("resources"), default_gpus=0 if is_ngram(model) else tp)
    if resources.gpus == 0 and tp > 1:
        fields.errors.append(f"{fields.path}.resources.gpus: tensor parallelism needs one GPU per shard; "
                             f"set gpus >= {tp} or tensorParallelSize: 1")
    elif 0 < resources.gpus < tp:
        fields.errors.append(f"{fields.path}.resources.gpus: {resources.gpus} GPUs cannot hold {tp} shards")
    # Like the API server's structural defaulting: every metric with a default is on unless set otherwise.
    scaling = fields.child("autoscaling")
    scaling.only(*metrics)
    targets: dict[str, float] = {}
    for metric in metrics:
        ceiling = 1.0 if metric == "kvUtilization" else None
        value = scaling.number(metric, default_targets.get(metric), low=0.0, high=ceiling, exclusive_low=True)
        if value is not None:
            targets[metric] = value
    return RoleSpec(
        model=model,
        replicas=Replicas(min=fewest, max=most),
        resources=resources,
        tensor_parallel_size=tp,
        node_selector=fields.string_map("nodeSelector"),
        tolerations=fields.object_list("tolerations"),
        affinity=_affinity(fields.child("affinity")),
        env=_env(fields, "env"),
        metric_targets=targets,
        decode_ahead=fields.string("decodeAhead", "auto", choices=DECODE_AHEAD_MODES) if role == "target" else "auto",
    )


def _canary(fields: _Fields) -> CanarySpec:
    fields.only("model", "weight", "replicas", "promotion", "proposer", "ngram")
    model = _draft_source(fields)
    weight = fields.integer("weight", 10, low=1, high=100)
    promotion_fields = fields.child("promotion")
    promotion_fields.only("metric", "confidence", "minRequests", "stepPercent", "maxWeight", "intervalSeconds")
    promotion = PromotionPolicy(
        metric=promotion_fields.string("metric", "tokensPerSecond", choices=PROMOTION_METRICS),
        confidence=promotion_fields.number("confidence", 0.95, low=0.5, high=0.9999, exclusive_low=True),
        min_requests=promotion_fields.integer("minRequests", 200, low=1),
        step_percent=promotion_fields.integer("stepPercent", 10, low=1, high=100),
        max_weight=promotion_fields.integer("maxWeight", 50, low=1, high=100),
        interval_seconds=promotion_fields.number("intervalSeconds", 60.0, low=1.0),
    )
    if weight > promotion.max_weight:
        fields.errors.append(f"{fields.path}.weight: {weight} exceeds promotion.maxWeight ({promotion.max_weight})")
    return CanarySpec(model=model, weight=weight, replicas=fields.integer("replicas", 1, low=1, high=100),
                      promotion=promotion)


def _internal_tls(fields: _Fields) -> InternalTLS:
    fields.only("secretName", "mutual", "serverName")
    return InternalTLS(
        secret_name=fields.name("secretName"),
        mutual=fields.boolean("mutual", True),
        server_name=fields.name("serverName", None, pattern=HOST_NAME, what="a DNS host name"),
    )


def _worker_auth(fields: _Fields) -> str:
    fields.only("secretName")
    return fields.name("secretName")


def _image_pull_secrets(fields: _Fields) -> tuple[str, ...]:
    """LocalObjectReferences ({name: SECRET}) in the spec; the names alone in the typed value."""
    names = []
    for index, item in enumerate(fields.object_list("imagePullSecrets")):
        reference = _Fields(item, f"{fields.path}.imagePullSecrets[{index}]", fields.errors)
        reference.only("name")
        names.append(reference.name("name"))
    return tuple(names)


def _check_colocated(coordinator: CoordinatorSpec, has_resources: bool, errors: list[str]) -> None:
    """What a coordinator of its own has and a co-located one cannot: said, rather than silently ignored."""
    if coordinator.replicas != 1:
        errors.append(f"spec.coordinator.replicas: {coordinator.replicas} does not apply with colocated: true; the "
                      "coordinator runs in every target pod, so the public API has spec.target.replicas (autoscaled)")
    if has_resources:
        errors.append("spec.coordinator.resources: does not apply with colocated: true; the coordinator shares the "
                      "target container's (spec.target.resources)")


def parse_spec(raw: Mapping[str, Any] | None, name: str | None = None) -> DeploymentSpec:
    """Validate a SpeculativeDeployment spec (and its name, if given) and fill its defaults;
    raise InvalidSpecError listing every problem."""
    errors: list[str] = []
    if name is not None and (len(name) > MAX_NAME_LENGTH or not DNS_1035_LABEL.match(name)):
        errors.append(f"metadata.name: {name!r} must be a lowercase DNS label of at most {MAX_NAME_LENGTH} "
                      f"characters starting with a letter, to name the Services NAME-target, NAME-draft-canary, ...")
    top = _Fields(raw, "spec", errors)
    top.only("image", "imagePullPolicy", "imagePullSecrets", "numSpeculativeTokens", "target", "draft", "coordinator",
             "canary", "autoscaling", "modelCache", "telemetry", "tls", "workerAuth", "batchInvariant")
    image = top.string("image")
    pull_policy = top.string("imagePullPolicy", None, choices=PULL_POLICIES)
    pull_secrets = _image_pull_secrets(top)
    k = top.integer("numSpeculativeTokens", DEFAULT_K, low=0, high=16)
    target = _role(top.child("target"), "target", TARGET_METRICS, DEFAULT_TARGET_METRICS)
    draft = _role(top.child("draft"), "draft", DRAFT_METRICS, DEFAULT_DRAFT_METRICS)
    if draft.tensor_parallel_size > target.tensor_parallel_size:
        errors.append(f"spec.draft.tensorParallelSize: the draft ({draft.tensor_parallel_size}) must not be sharded "
                      f"over more GPUs than the target ({target.tensor_parallel_size})")
    batch_invariant = top.boolean("batchInvariant", False)
    if batch_invariant and max(target.tensor_parallel_size, draft.tensor_parallel_size) > 1:
        errors.append("spec.batchInvariant: needs target and draft tensorParallelSize 1 (the all-reduce between "
                      "shards sums in an order chosen by the batch's size)")

    coordinator_fields = top.child("coordinator")
    coordinator_fields.only("replicas", "resources", "port", "httpPort", "tls", "auth", "colocated", "arrivalWindowMs",
                            "maxNumSeqs", "maxWaiting")
    public_tls = coordinator_fields.child("tls")
    public_tls.only("secretName")
    auth = coordinator_fields.child("auth")
    auth.only("tokenSecretName")
    coordinator = CoordinatorSpec(
        replicas=coordinator_fields.integer("replicas", 1, low=1, high=100),
        resources=_resources(coordinator_fields.child("resources"), default_gpus=0, allow_gpus=False),
        port=coordinator_fields.integer("port", 50051, low=1, high=65535),
        http_port=coordinator_fields.integer("httpPort", 8000, low=0, high=65535),
        tls_secret_name=public_tls.name("secretName") if coordinator_fields.has("tls") else None,
        auth_token_secret_name=auth.name("tokenSecretName") if coordinator_fields.has("auth") else None,
        colocated=coordinator_fields.boolean("colocated", False),
        arrival_window_ms=coordinator_fields.number("arrivalWindowMs", 0.0, low=0.0, high=1000.0),
        max_num_seqs=coordinator_fields.integer("maxNumSeqs", None, low=1, high=65536),
        max_waiting=coordinator_fields.integer("maxWaiting", None, low=1, high=1048576),
    )
    if coordinator.colocated:
        _check_colocated(coordinator, coordinator_fields.has("resources"), errors)
    canary = _canary(top.child("canary")) if top.has("canary") else None

    scaling = top.child("autoscaling")
    scaling.only("stabilizationWindowSeconds", "scaleUpStabilizationWindowSeconds", "scaleDownCooldownSeconds",
                 "maxStep", "intervalSeconds")
    autoscaling = AutoscalingSpec(
        scale_down_window_seconds=scaling.number("stabilizationWindowSeconds", 300.0, low=0.0, high=3600.0),
        scale_up_window_seconds=scaling.number("scaleUpStabilizationWindowSeconds", 0.0, low=0.0, high=3600.0),
        scale_down_cooldown_seconds=scaling.number("scaleDownCooldownSeconds", 120.0, low=0.0, high=3600.0),
        max_step=scaling.integer("maxStep", 2, low=1, high=100),
        interval_seconds=scaling.number("intervalSeconds", 30.0, low=1.0, high=3600.0),
    )
    cache = top.child("modelCache")
    cache.only("claimName", "sizeLimit")
    telemetry = top.child("telemetry")
    telemetry.only("otlpEndpoint")
    spec = DeploymentSpec(
        image=image,
        image_pull_policy=pull_policy,
        image_pull_secrets=pull_secrets,
        num_speculative_tokens=k,
        target=target,
        draft=draft,
        coordinator=coordinator,
        canary=canary,
        autoscaling=autoscaling,
        model_cache_claim=cache.string("claimName", None),
        model_cache_size_limit=cache.string("sizeLimit", None),
        otlp_endpoint=telemetry.string("otlpEndpoint", None),
        tls=_internal_tls(top.child("tls")) if top.has("tls") else None,
        worker_auth_secret_name=_worker_auth(top.child("workerAuth")) if top.has("workerAuth") else None,
        batch_invariant=batch_invariant,
    )
    if errors:
        raise InvalidSpecError(errors)
    return spec
