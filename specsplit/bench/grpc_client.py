"""A benchmark client of this server's gRPC API (GenerateStream), timed per stream message; the last message
carries usage and what speculation did. `timeout` is how long a request may go without a message (as the HTTP
client's read timeout), not a deadline on the whole stream: a long generation is not cut short. TLS and mutual TLS
as `specsplit.client.Client` (services/rpc/security.ChannelSecurity)."""

import asyncio

import grpc

from specsplit.bench.request_record import RequestClock, RequestRecord, ServerGone
from specsplit.bench.workloads import BenchRequest
from specsplit.proto.v1 import generation_pb2_grpc
from specsplit.services.rpc.security import ChannelSecurity
from specsplit.services.coordinator import public_messages as pm
from specsplit.services.sampling_params import SamplingParams


class GrpcClient:
    def __init__(self, address: str, token: str | None = None, temperature: float = 0.0, timeout: float | None = None,
                 security: ChannelSecurity | None = None):
        self.address = address
        self.security = security or ChannelSecurity()
        self.temperature = temperature
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel = None
        self._stub = None

    async def start(self, connect_timeout: float = 30.0) -> "GrpcClient":
        if self.security.enabled:
            self._channel = grpc.aio.secure_channel(self.address, self.security.credentials(),
                                                    options=self.security.options())
        else:
            self._channel = grpc.aio.insecure_channel(self.address)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), connect_timeout)
        except TimeoutError:
            raise ServerGone(f"{self.address}: no answer in {connect_timeout:.0f}s") from None
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        return self

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def send(self, request: BenchRequest) -> RequestRecord:
        temperature = self.temperature if request.temperature is None else request.temperature
        params = SamplingParams(temperature=temperature, seed=request.seed, max_tokens=request.output_len,
                                ignore_eos=True)
        message = pm.request_pb(request.prompt, params, messages=request.messages)
        record = RequestRecord()
        clock = RequestClock(record)
        last = None
        call = self._stub.GenerateStream(message, metadata=self._metadata)
        try:
            while (message := await asyncio.wait_for(call.read(), self.timeout)) is not grpc.aio.EOF:
                last = message
                if last.token_ids:
                    clock.output()
        except TimeoutError:
            call.cancel()
            record.error = f"DEADLINE_EXCEEDED: no message in {self.timeout:g}s"
            return clock.finish()
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                raise ServerGone(f"{self.address}: UNAVAILABLE: {error.details()}") from None
            record.error = f"{error.code().name}: {error.details()}"
            return clock.finish()
        record.prompt_tokens = last.usage.prompt_tokens
        record.output_tokens = last.usage.completion_tokens
        record.rounds = last.speculation.rounds
        record.drafted_tokens = last.speculation.drafted_tokens
        record.accepted_tokens = last.speculation.accepted_tokens
        record.ok = True
        return clock.finish()
