"""Run a draft or target worker as its own process: load the model, serve gRPC, expire abandoned sequences."""

import asyncio
import logging
import os
import signal
import sys

from specsplit.services.models.loader import load_model
from specsplit.services.models.layout_calibration import role_rows, use_calibrated_layout
from specsplit.services.rpc.caller_auth import SecretCheck
from specsplit.services.rpc.round_channel import PREFILL, REQUEST, RoundChannelServer, server_ssl_context, spin_wait_default
from specsplit.services.rpc.server import start_server
from specsplit.services.rpc.worker_credentials import is_loopback, listen_host, worker_secret_interceptor
from specsplit.services.runtime.batch_invariance import check_tensor_parallel_sizes
from specsplit.services.runtime.model_runner import ModelRunner
from specsplit.services.telemetry import round_timeline
from specsplit.services.telemetry.service_observability import observe_worker

log = logging.getLogger(__name__)


def build_worker_service(role: str, model: str, dtype="float32", device="cpu", num_kv_blocks=None, block_size=16, draft_support=32,
                         synthetic_acceptance=None, weight_format="auto", prefix_caching=True, warm_up_k=4, acceptance=None,
                         layout_k=4, tensor_parallel_size=1, proposer="model", ngram_max=None, ngram_min=None,
                         decode_ahead="auto"):
    """`layout_k`: the proposals per round that an "auto" layout is measured for (0: a target decoding alone).
    `decode_ahead`: whether a target runs plain decodes' next steps ahead (target/decode_ahead.py; auto = on a GPU).
    `tensor_parallel_size` > 1: this process is rank 0 and serves; the other ranks are its children (a sharded model
    keeps the fixed default layouts). `proposer` "ngram": a draft that looks proposals up, with no model."""
    if role == "draft" and proposer == "ngram":  # prompt lookup: no model to load
        from specsplit.services.draft.ngram_proposer import NgramProposer
        from specsplit.services.draft.server import DraftService

        sizes = {k: v for k, v in (("max_n", ngram_max), ("min_n", ngram_min)) if v is not None}
        ngram = NgramProposer(**sizes)
        return DraftService(ngram, f"ngram[{ngram.min_n}-{ngram.max_n}]"), "specsplit.v1.DraftWorker"
    check_tensor_parallel_sizes({role: tensor_parallel_size})
    if tensor_parallel_size > 1:
        from specsplit.services.models.weight_formats import target_weight_request
        from specsplit.services.runtime.tensor_parallel_launch import start_tensor_parallel_runner

        if role == "target":
            weight_format = target_weight_request(weight_format, speculative=layout_k > 0)
        runner = start_tensor_parallel_runner(model, tensor_parallel_size, role, dtype, device, weight_format,
                                              on_rank_lost=_replica_down, num_blocks=num_kv_blocks,
                                              block_size=block_size, prefix_caching=prefix_caching)
        loaded = runner.loaded
        for rank, pid in enumerate(runner.followers.pids, start=1):
            print(f"specsplit {role} tensor-parallel rank {rank} pid {pid}", flush=True)
    else:
        loaded = load_model(model, dtype, device)
        use_calibrated_layout(loaded, weight_format, role, role_rows(role, layout_k))
        runner = ModelRunner(loaded, num_blocks=num_kv_blocks, block_size=block_size, prefix_caching=prefix_caching)
    if role == "draft":
        from specsplit.services.draft.proposer import DraftProposer
        from specsplit.services.draft.server import DraftService

        proposer = DraftProposer(runner, support_size=draft_support)
        _warm_up(proposer, DraftProposer.warm_up_bound(warm_up_k))
        return DraftService(proposer, loaded.name), "specsplit.v1.DraftWorker"
    from specsplit.services.target.server import TargetService
    from specsplit.services.target.verifier import TargetVerifier

    # synthetic_acceptance is for benchmarks only (not lossless); the verifier logs a loud warning when it is set, and
    # when `acceptance` (an AcceptancePolicy) enables typical acceptance, which is not lossless either.
    verifier = TargetVerifier(runner, synthetic_acceptance=synthetic_acceptance, acceptance=acceptance,
                              decode_ahead=decode_ahead)
    _warm_up(verifier, warm_up_k)
    return TargetService(verifier, loaded.name), "specsplit.v1.TargetWorker"


def _replica_down(reason: str) -> None:
    """A rank of this tensor-parallel replica is gone (the others are already stopped): the replica cannot serve, so
    the process exits at once and its coordinators fail over as for any lost replica."""
    log.error("tensor-parallel rank lost (%s): this replica stops", reason)
    sys.stderr.flush()
    os._exit(REPLICA_DOWN_EXIT_CODE)


REPLICA_DOWN_EXIT_CODE = 75  # EX_TEMPFAIL: a restart (by the pod's controller) can bring the replica back


def _warm_up(worker, max_k: int) -> None:
    """On a GPU, capture the rounds' graphs before listening (none to capture on the CPU)."""
    if max_k > 0 and worker.runner.graphs is not None:
        import time

        started = time.perf_counter()
        captured = worker.warm_up(max_k=max_k)
        log.warning("captured %d CUDA graphs for up to k=%d in %.1f s", captured, max_k, time.perf_counter() - started)


class RunningWorker:
    """A worker serving gRPC and its round channel, with its abandoned-sequence expiry; `stop()` ends them all and
    frees the model."""

    def __init__(self, role, service, server, address, observability, expirer, channel):
        self.role, self.service, self.server, self.address = role, service, server, address
        self.observability, self.expirer, self.channel = observability, expirer, channel

    async def stop(self) -> None:
        self.expirer.cancel()
        if self.channel is not None:
            await self.channel.stop()
        await self.server.stop(grace=2.0)
        self.service.batcher.stop()
        self.observability.close()
        worker = getattr(self.service, "verifier", None) or getattr(self.service, "proposer", None)
        if hasattr(worker.runner, "close"):  # a tensor-parallel replica: stop the other ranks
            worker.runner.close()


async def start_worker(role: str, model: str, host: str, port: int, lease_seconds: float = 600.0, metrics_port: int = -1,
                       security=None, secret: str | None = None, allow_unauthenticated: bool = False,
                       metrics_host: str = "127.0.0.1", round_port: int = 0,
                       **model_options) -> RunningWorker:
    """`round_port`: where the round channel listens (rpc/round_channel.py; Describe tells coordinators): 0 = any
    free port, -1 = no channel (rounds over gRPC only)."""
    round_timeline.set_role(role)
    if str(model_options.get("device", "cpu")).startswith("cuda"):
        # The loop and the compute thread share the GIL: a short switch interval hands it to the thread back from a
        # device wait within half a millisecond instead of up to five. Not on the CPU, where the compute holds the
        # GIL between torch ops and every forced switch slows it (a tiny draft's call of four steps: 3.43-3.67 ms
        # at 5 ms against 3.62-3.78 at 0.5 ms; BENCHMARKS.md, issue 27).
        sys.setswitchinterval(0.0005)
    host = listen_host(host, secret, bool(security and security.client_ca_file), allow_unauthenticated)
    service, service_name = build_worker_service(role, model, **model_options)
    observability = observe_worker(role, service, metrics_host, metrics_port)  # metrics_port < 0: none
    check = SecretCheck([secret]) if secret else None  # one failure throttle for gRPC and the round channel
    interceptors = [worker_secret_interceptor(check)] if check else []
    service.describe_model_path = bool(secret or (security and security.client_ca_file)) or is_loopback(host)
    server, bound, _ = await start_server(service.add_to, [service_name], host, port, interceptors, security=security)
    channel = None
    if round_port >= 0:
        runner = getattr(service, "verifier", getattr(service, "proposer", None))
        device = getattr(getattr(runner, "runner", None), "device", None)
        channel = RoundChannelServer({REQUEST: service.round.frame, PREFILL: service.prefills.frame}, check,
                                     server_ssl_context(security), spin=spin_wait_default(getattr(device, "type", "cpu") == "cuda"))
        service.round_port = await channel.start(host, round_port)
    print(f"specsplit {role} listening on {host}:{bound}", flush=True)
    sys.stdout.flush()

    async def expire_abandoned():
        # A coordinator that died cannot release its sequences: free any untouched for `lease_seconds`.
        while True:
            await asyncio.sleep(min(lease_seconds / 4, 30.0))
            expired = await service.batcher.submit("expire", [lease_seconds])
            if expired and expired[0]:
                log.warning("released %d abandoned sequences", len(expired[0]))

    return RunningWorker(role, service, server, f"{host}:{bound}", observability,
                         asyncio.create_task(expire_abandoned()), channel)


async def serve_worker(role: str, model: str, host: str, port: int, lease_seconds: float = 600.0, metrics_port: int = -1,
                       **options) -> None:
    worker = await start_worker(role, model, host, port, lease_seconds, metrics_port, **options)
    await until_stopped()
    await worker.stop()


async def until_stopped() -> None:
    """Return on SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
