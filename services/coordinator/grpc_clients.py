"""Draft and target replicas reached over gRPC: the same interface as the in-process clients."""

import asyncio
import socket

import grpc

from specsplit.proto.v1 import worker_pb2, worker_pb2_grpc
from specsplit.services.coordinator.call_streams import CallStream
from specsplit.services.errors import Unavailable
from specsplit.services.rpc import worker_messages as msg
from specsplit.services.rpc.round_channel import PREFILL, RoundChannelClient, client_ssl_context
from specsplit.services.rpc.server import MAX_MESSAGE_BYTES
from specsplit.services.rpc.status_codes import error_from_rpc
from specsplit.services.rpc.worker_credentials import COORDINATOR_ID, worker_call_metadata
from specsplit.services.telemetry import round_timeline
from specsplit.services.telemetry.trace_propagation import outgoing_traceparents

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def expand_address(address: str) -> list[str]:
    """HOST:PORT -> one address per IP when HOST resolves to several (a headless Service), else itself."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, got '{address}'")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return [address]
    ips = sorted({info[4][0] for info in infos})
    if len(ips) <= 1:
        return [address]
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


WORKER_TRANSPORTS = ("channel", "stream", "unary")


class _GrpcWorkerClient:
    stub_class = None
    role = ""
    stream_method = ""  # the round's call (Propose or Verify), also served over a long-lived stream

    def __init__(self, address: str, call_timeout: float = 60.0, security=None, transport: str = "channel",
                 spin_wait: bool = False):
        """`transport`: how the round's call travels: "channel" (the worker's round channel, rpc/round_channel.py,
        where it has one, else as "stream"), "stream" (one long-lived bidirectional gRPC stream, call_streams.py) or
        "unary" (a gRPC call per round). Trace contexts travel inside the messages in every case. `spin_wait`: keep
        this process's event loop turning while a round's answer is awaited (round_channel.LoopSpinner)."""
        if transport not in WORKER_TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(WORKER_TRANSPORTS)}, not {transport!r}")
        self.name = address
        self.address = address
        self.call_timeout = call_timeout
        if security is not None and security.enabled:
            options = CHANNEL_OPTIONS + security.options()
            self.channel = grpc.aio.secure_channel(address, security.credentials(), options=options)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = self.stub_class(self.channel)
        self.security = security
        self.transport = transport
        self.spin_wait = spin_wait
        self.round_channel: RoundChannelClient | None = None
        self._metadata = worker_call_metadata(security.secret if security is not None else None)
        self.info: worker_pb2.WorkerInfo | None = None
        self.stream = None
        if transport != "unary":
            open_stream = getattr(self.stub, self.stream_method + "Stream")
            # The stream carries what every call does: the worker secret and this coordinator's id.
            self.stream = CallStream(lambda: open_stream(metadata=self._metadata))

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def synthetic_acceptance(self) -> float | None:
        """A target's synthetic acceptance rate (benchmark only, NOT lossless); None in serving."""
        return self.info.synthetic_acceptance if self.info.HasField("synthetic_acceptance") else None

    @property
    def proposer_kind(self) -> str:
        """A draft's proposer: "model" or "ngram" (older workers say nothing: "model")."""
        return self.info.proposer or "model"

    async def connect(self, timeout: float = 120.0) -> "_GrpcWorkerClient":
        """Wait until the worker answers Describe (it may still be loading its model)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                self.info = await self.stub.Describe(worker_pb2.DescribeRequest(), timeout=5.0, metadata=self._metadata)
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNAUTHENTICATED:  # waiting will not help
                    raise Unavailable(f"{self.role} at {self.address} refused this coordinator: {error.details()} "
                                      "(give it the workers' secret: --worker-secret-file or $SPECSPLIT_WORKER_SECRET)") from None
                if asyncio.get_running_loop().time() > deadline:
                    raise Unavailable(f"{self.role} at {self.address} did not answer: {error.details()}") from None
                await asyncio.sleep(0.5)
                continue
            if self.info.role != self.role:
                raise Unavailable(f"{self.address} is a {self.info.role} worker, not a {self.role}")
            self._open_round_channel()
            return self

    def _open_round_channel(self) -> None:
        if self.transport == "channel" and self.info.round_port and self.round_channel is None:
            host = self.address.rpartition(":")[0].strip("[]")
            security = self.security
            self.round_channel = RoundChannelClient(
                host, self.info.round_port, COORDINATOR_ID, security.secret if security is not None else None,
                client_ssl_context(security), (security.server_name if security is not None else None) or host,
                spin=self.spin_wait)

    async def describe(self) -> worker_pb2.WorkerInfo:
        """The worker's self-description; a worker restarted at this address may serve its round channel on another
        port (or none, or take prefills there or not): the client follows it (the probes of a replica marked down
        describe it before it is used again, replica_health.py)."""
        info = await self._call(self.stub.Describe, worker_pb2.DescribeRequest())
        if self.info is not None and (info.round_port, info.round_channel_prefills) != (
                self.info.round_port, self.info.round_channel_prefills):
            if self.round_channel is not None:
                self.round_channel.close()
                self.round_channel = None
            self.info = info
            self._open_round_channel()
        return info

    async def release(self, handles):
        await self._call(self.stub.Release, worker_pb2.ReleaseRequest(handles=handles))

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self.call_timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None

    async def _prefill_call(self, request, response_type):
        """A prefill: over the round channel where the worker takes prefills there (a request's first token waits
        on it), else unary gRPC."""
        if self.round_channel is not None and self.info.round_channel_prefills:
            return await self.round_channel.request(request, response_type, PREFILL)
        return await self._call(self.stub.Prefill, request)

    async def _round_call(self, request):
        """The round's call: over the stream when there is one, else unary. The caller bounds its time (the
        coordinator's per-replica deadline, replica_health.py)."""
        if self.round_channel is not None:
            return await self.round_channel.request(request, self.response_type)
        if self.stream is None or self.stream.unsupported:
            return await self._call(getattr(self.stub, self.stream_method), request)
        try:
            return await self.stream.request(request)
        except grpc.RpcError as error:
            if self.stream.unsupported:  # an older worker: unary from now on
                return await self._call(getattr(self.stub, self.stream_method), request)
            raise error_from_rpc(error) from None

    async def close(self):
        if self.round_channel is not None:
            self.round_channel.close()
        if self.stream is not None:
            self.stream.close()
        await self.channel.close()


class GrpcDraftClient(_GrpcWorkerClient):
    stub_class = worker_pb2_grpc.DraftWorkerStub
    role = "draft"
    stream_method = "Propose"
    response_type = worker_pb2.ProposeResponse

    async def prefill(self, items):
        request = msg.draft_prefill_request(items, outgoing_traceparents())
        return msg.draft_prefill_results(await self._prefill_call(request, worker_pb2.DraftPrefillResponse))

    async def propose(self, items):
        request = msg.propose_request(items, outgoing_traceparents())
        round_timeline.mark("propose.built")
        response = await self._round_call(request)
        round_timeline.mark("propose.answered")
        results = msg.proposals(response)
        round_timeline.mark("propose.unpacked")
        return results


class GrpcTargetClient(_GrpcWorkerClient):
    stub_class = worker_pb2_grpc.TargetWorkerStub
    role = "target"
    stream_method = "Verify"
    response_type = worker_pb2.VerifyResponse

    async def prefill(self, items):
        request = msg.target_prefill_request(items, outgoing_traceparents())
        response = await self._prefill_call(request, worker_pb2.VerifyResponse)
        return msg.verdicts(response, [i.logprobs is not None for i in items])

    async def verify(self, items):
        request = msg.verify_request(items, outgoing_traceparents())
        round_timeline.mark("verify.built")
        response = await self._round_call(request)
        round_timeline.mark("verify.answered")
        results = msg.verdicts(response, [i.logprobs is not None for i in items])
        round_timeline.mark("verify.unpacked")
        return results
