"""Run a draft or target worker as its own process: load the model, serve gRPC, expire abandoned sequences."""

import asyncio
import logging
import signal
import sys

from specsplit.services.models.loader import load_model
from specsplit.services.models.weight_formats import use_weight_format
from specsplit.services.rpc.server import start_server
from specsplit.services.rpc.worker_credentials import is_loopback, listen_host, worker_secret_interceptor
from specsplit.services.runtime.model_runner import ModelRunner
from specsplit.services.telemetry.service_observability import observe_worker

log = logging.getLogger(__name__)


def build_worker_service(role: str, model: str, dtype="float32", device="cpu", num_kv_blocks=None, block_size=16, draft_support=32,
                         synthetic_acceptance=None, weight_format="auto", prefix_caching=True, warm_up_k=4, acceptance=None):
    loaded = load_model(model, dtype, device)
    use_weight_format(loaded, weight_format, role)
    runner = ModelRunner(loaded, num_blocks=num_kv_blocks, block_size=block_size, prefix_caching=prefix_caching)
    if role == "draft":
        from specsplit.services.draft.proposer import DraftProposer
        from specsplit.services.draft.server import DraftService

        proposer = DraftProposer(runner, support_size=draft_support)
        _warm_up(proposer, warm_up_k)
        return DraftService(proposer, loaded.name), "specsplit.v1.DraftWorker"
    from specsplit.services.target.server import TargetService
    from specsplit.services.target.verifier import TargetVerifier

    # synthetic_acceptance is for benchmarks only (not lossless); the verifier logs a loud warning when it is set, and
    # when `acceptance` (an AcceptancePolicy) enables typical acceptance, which is not lossless either.
    verifier = TargetVerifier(runner, synthetic_acceptance=synthetic_acceptance, acceptance=acceptance)
    _warm_up(verifier, warm_up_k)
    return TargetService(verifier, loaded.name), "specsplit.v1.TargetWorker"


def _warm_up(worker, max_k: int) -> None:
    """On a GPU, capture the rounds' graphs before listening (none to capture on the CPU)."""
    if max_k > 0 and worker.runner.graphs is not None:
        import time

        started = time.perf_counter()
        captured = worker.warm_up(max_k=max_k)
        log.warning("captured %d CUDA graphs for up to k=%d in %.1f s", captured, max_k, time.perf_counter() - started)


async def serve_worker(role: str, model: str, host: str, port: int, lease_seconds: float = 600.0, metrics_port: int = -1,
                       security=None, secret: str | None = None, allow_unauthenticated: bool = False,
                       metrics_host: str = "127.0.0.1", **model_options) -> None:
    host = listen_host(host, secret, bool(security and security.client_ca_file), allow_unauthenticated)
    service, service_name = build_worker_service(role, model, **model_options)
    observability = observe_worker(role, service, metrics_host, metrics_port)  # metrics_port < 0: none
    interceptors = [worker_secret_interceptor(secret)] if secret else []
    service.describe_model_path = bool(secret or (security and security.client_ca_file)) or is_loopback(host)
    server, bound, _ = await start_server(service.add_to, [service_name], host, port, interceptors, security=security)
    print(f"specsplit {role} listening on {host}:{bound}", flush=True)
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def expire_abandoned():
        # A coordinator that died cannot release its sequences: free any untouched for `lease_seconds`.
        while True:
            await asyncio.sleep(min(lease_seconds / 4, 30.0))
            expired = await service.batcher.submit("expire", [lease_seconds])
            if expired and expired[0]:
                log.warning("released %d abandoned sequences", len(expired[0]))

    expirer = asyncio.create_task(expire_abandoned())
    await stop.wait()
    expirer.cancel()
    await server.stop(grace=2.0)
    service.batcher.stop()
    observability.close()
