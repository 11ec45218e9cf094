"""Run the coordinator as its own process: connect to the replicas, then serve the public API."""

import asyncio
import logging

from specsplit.services.coordinator.coordinator import Coordinator, CoordinatorConfig
from specsplit.services.coordinator.grpc_clients import GrpcDraftClient, GrpcTargetClient, expand_address
from specsplit.services.coordinator.replica_pools import ReplicaPool
from specsplit.services.coordinator.server import GenerationService
from specsplit.services.errors import InvalidArgument
from specsplit.services.rpc.caller_auth import SecretCheck
from specsplit.services.rpc.round_channel import spin_wait_default
from specsplit.services.rpc.security import BearerTokenInterceptor
from specsplit.services.rpc.server import start_server
from specsplit.services.rpc.worker_process import until_stopped
from specsplit.services.telemetry import round_timeline
from specsplit.services.telemetry.service_observability import observe_coordinator

log = logging.getLogger(__name__)


def load_tokenizer(source: str | None):
    if not source:
        return None
    from transformers import AutoTokenizer

    from specsplit.services.models.loader import resolve_model_path

    path = resolve_model_path(source)
    if path.is_file():
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path)


def worker_tokenizer(model_path: str):
    """The tokenizer of the folder the target loaded, or None where it has none (a folder of weights alone serves
    token-id prompts, as the worker itself does)."""
    try:
        return load_tokenizer(model_path)
    except (OSError, ValueError) as error:
        log.warning("the target's model at %s has no tokenizer that loads here: %s", model_path, error)
        return None


async def connect_pools(target_addresses, draft_variants, connect_timeout, security=None, local_target=None,
                        client_options: dict | None = None):
    """-> (target pool, draft pools); draft_variants is [(name, weight, [addresses])]. `local_target`: a replica in
    this process, first in the pool and preferred (see ReplicaPool.preferred). `client_options`: the worker clients'
    transport and spin_wait (grpc_clients.py)."""
    options = client_options or {}
    targets = [GrpcTargetClient(a, security=security, **options) for spec in target_addresses for a in expand_address(spec)]
    drafts = [
        (name, weight, [GrpcDraftClient(a, security=security, **options) for spec in addrs for a in expand_address(spec)])
        for name, weight, addrs in draft_variants
    ]
    await asyncio.gather(*(c.connect(connect_timeout) for c in targets), *(c.connect(connect_timeout) for _, _, cs in drafts for c in cs))
    if local_target is not None:
        targets.insert(0, local_target)
    vocab = {c.vocab_size for c in targets}
    if len(vocab) != 1:
        raise InvalidArgument(f"target replicas disagree on the vocabulary: {sorted(vocab)}")
    for name, _, clients in drafts:
        for c in clients:
            if c.vocab_size and c.vocab_size != targets[0].vocab_size:  # 0: any vocabulary (n-gram proposer)
                raise InvalidArgument(
                    f"mismatched vocabularies: draft {c.address} ({name}) has {c.vocab_size} tokens, target has {targets[0].vocab_size}"
                )
    pool = ReplicaPool("target", targets, preferred=local_target.name if local_target is not None else None)
    return pool, [ReplicaPool(name, clients, weight) for name, weight, clients in drafts]


class RunningCoordinator:
    """A coordinator serving the public gRPC API (and the OpenAI HTTP API where asked); `stop()` ends it."""

    def __init__(self, coordinator, server, address, http, observability, watching):
        self.coordinator, self.server, self.address = coordinator, server, address
        self.http, self.observability, self.watching = http, observability, watching

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace=2.0)
        if self.watching is not None:
            self.watching.cancel()
        await self.coordinator.close()
        self.observability.close()


async def start_coordinator(
    targets: list[str],
    draft_variants: list[tuple[str, float, list[str]]],
    host: str,
    port: int,
    tokenizer: str | None = None,
    config: CoordinatorConfig | None = None,
    connect_timeout: float = 300.0,
    metrics_port: int = -1,
    metrics_host: str = "127.0.0.1",
    draft_variants_file: str | None = None,
    security=None,
    worker_security=None,
    auth_tokens: list[str] | None = None,
    http_port: int = -1,
    local_target=None,
    worker_transport: str = "channel",
    spin_wait: str = "auto",
) -> RunningCoordinator:
    """`local_target`: a target replica in this process (the co-located mode, coordinator/colocated.py), preferred
    for every sequence; `targets` are then the other replicas it may fail over to. `worker_transport`: how rounds
    reach workers ("channel", "stream", "unary"; grpc_clients.py); `spin_wait`: "auto", "on" or "off" (keep the
    loop turning while a round's answer is awaited; auto: where at least four cores leave room)."""
    round_timeline.set_role("coordinator")
    client_options = dict(transport=worker_transport, spin_wait=spin_wait == "on" or (
        spin_wait == "auto" and spin_wait_default(on_accelerator=True)))
    target_pool, draft_pools = await connect_pools(targets, draft_variants, connect_timeout, worker_security,
                                                   local_target, client_options)
    first = target_pool.replicas[0].info
    if tokenizer:
        tok = load_tokenizer(tokenizer)
    else:
        tok = worker_tokenizer(first.model_path)
        if tok is None:
            log.warning("no tokenizer: the target's model folder has none, or the target does not say where its "
                        "model is (it admits unauthenticated callers); token-id prompts only, or give --tokenizer "
                        "MODEL for text prompts")
    coordinator = Coordinator(target_pool, draft_pools, tok, list(first.eos_token_ids), config)
    observability = observe_coordinator(coordinator, first.model, metrics_host, metrics_port)  # metrics_port < 0: none
    watching = None
    if draft_variants_file:
        from specsplit.services.coordinator.draft_variants_file import start_draft_variants_watcher

        _, watching = await start_draft_variants_watcher(draft_variants_file, coordinator, connect_timeout, worker_security,
                                                         client_options)
    service = GenerationService(coordinator, variant_stats=observability.canary.to_pb)
    interceptors = list(observability.interceptors)
    tokens = SecretCheck(auth_tokens) if auth_tokens else None  # one failure throttle for the gRPC and HTTP APIs
    if tokens is not None:
        interceptors.insert(0, BearerTokenInterceptor(tokens))
    http = None
    if http_port >= 0:  # the OpenAI-compatible API, on this event loop, with the gRPC API's tokens and TLS
        from specsplit.services.coordinator.openai_http import OpenAIHTTPServer

        http = OpenAIHTTPServer(coordinator, first.model, tokens, security)
        try:
            bound_http = await http.start(host, http_port)
        except OSError as error:  # a busy port costs the HTTP API, not the gRPC one (as for metrics)
            log.error("OpenAI HTTP API not served on %s:%s: %s", host, http_port, error)
            await http.stop()
            http = None
        else:
            scheme = "https" if security is not None and security.cert_file else "http"
            print(f"specsplit coordinator OpenAI API on {scheme}://{_display_host(host)}:{bound_http}/v1", flush=True)
    server, bound, _ = await start_server(service.add_to, ["specsplit.v1.Generation"], host, port, interceptors, security)
    print(f"specsplit coordinator listening on {host}:{bound}", flush=True)
    return RunningCoordinator(coordinator, server, f"{host}:{bound}", http, observability, watching)


async def serve_coordinator(targets: list[str], draft_variants: list[tuple[str, float, list[str]]], host: str, port: int,
                            **options) -> None:
    running = await start_coordinator(targets, draft_variants, host, port, **options)
    await until_stopped()
    await running.stop()


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
