"""What the worker secret check and the malformed-request guard cost per call and per stream message.

  check_us       the secret interceptor's own work for a call with the right secret (read the metadata, compare in
                 constant time, hand back the method's handler), timed alone against a pass-through interceptor
  guard_us       the same for the malformed-request interceptor (its wrapped handler is built once per method)
  unary_us       a unary call over loopback gRPC, client and server in this process (median of interleaved rounds),
                 on a server with no interceptor ("none"), the malformed-request guard only ("guard", a worker
                 without a secret), and the guard plus the secret check ("secret", a worker with one)
  stream_msg_us  one message each way on an open bidirectional stream (ping-pong), for the same three servers: the
                 secret is checked when the stream opens, so "secret" should equal "guard" per message

    python bench/bench_auth_check.py [--calls 400] [--messages 2000] [--rounds 9]

On a shared machine take the differences between variants of the same round (they run interleaved, the order
rotated each round), not the absolute numbers.
"""

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from specsplit.proto.v1 import worker_pb2  # noqa: E402
from specsplit.services.rpc.caller_auth import SecretCheck  # noqa: E402
from specsplit.services.rpc.malformed_requests import MalformedRequestInterceptor  # noqa: E402
from specsplit.services.rpc.server import SERVER_OPTIONS  # noqa: E402
from specsplit.services.rpc.worker_credentials import (  # noqa: E402
    WORKER_SECRET_HEADER, worker_call_metadata, worker_secret_interceptor)

SECRET = "a-worker-secret-of-the-usual-length-0123456789abcdef"
SERVICE = "bench.Echo"


class PassThrough(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        return await continuation(details)


async def _interceptor_us(interceptor, n: int) -> float:
    """Seconds per intercept_service call (best of 5), for a valid call with the worker's usual metadata."""
    handler = grpc.unary_unary_rpc_method_handler(_unary, worker_pb2.ReleaseRequest.FromString,
                                                  worker_pb2.ReleaseResponse.SerializeToString)

    async def continuation(details):
        return handler

    details = SimpleNamespace(method="/specsplit.v1.TargetWorker/Verify",
                              invocation_metadata=tuple(worker_call_metadata(SECRET)) + (("user-agent", "grpc-python"),))
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(n):
            await interceptor.intercept_service(continuation, details)
        best = min(best, (time.perf_counter() - started) / n)
    return best * 1e6


async def _unary(request, context):
    return worker_pb2.ReleaseResponse(released=len(request.handles))


async def _stream(requests, context):
    async for request in requests:
        yield worker_pb2.ReleaseResponse(released=len(request.handles))


async def _server(interceptors):
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, worker_pb2.ReleaseRequest.FromString,
                                                     worker_pb2.ReleaseResponse.SerializeToString),
        "Stream": grpc.stream_stream_rpc_method_handler(_stream, worker_pb2.ReleaseRequest.FromString,
                                                        worker_pb2.ReleaseResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _unary_us(channel, calls: int) -> float:
    call = channel.unary_unary(f"/{SERVICE}/Unary", request_serializer=worker_pb2.ReleaseRequest.SerializeToString,
                               response_deserializer=worker_pb2.ReleaseResponse.FromString)
    request, metadata = worker_pb2.ReleaseRequest(handles=["h"]), worker_call_metadata(SECRET)
    started = time.perf_counter()
    for _ in range(calls):
        await call(request, metadata=metadata)
    return (time.perf_counter() - started) / calls * 1e6


async def _stream_msg_us(channel, messages: int) -> float:
    open_stream = channel.stream_stream(f"/{SERVICE}/Stream", request_serializer=worker_pb2.ReleaseRequest.SerializeToString,
                                        response_deserializer=worker_pb2.ReleaseResponse.FromString)
    call = open_stream(metadata=worker_call_metadata(SECRET))
    request = worker_pb2.ReleaseRequest(handles=["h"])
    await call.write(request)
    await call.read()  # the stream is open (and checked) before the clock starts
    started = time.perf_counter()
    for _ in range(messages):
        await call.write(request)
        await call.read()
    elapsed = time.perf_counter() - started
    await call.done_writing()
    return elapsed / messages * 1e6


async def main(args) -> list[dict]:
    rows = []
    passthrough = await _interceptor_us(PassThrough(), 20_000)
    check = await _interceptor_us(worker_secret_interceptor(SecretCheck([SECRET])), 20_000) - passthrough
    guard_interceptor = MalformedRequestInterceptor()
    guard = await _interceptor_us(guard_interceptor, 20_000) - passthrough
    rows.append({"measure": "check_us", "us": check})
    rows.append({"measure": "guard_us", "us": guard})
    variants = {"none": [], "guard": [MalformedRequestInterceptor()],
                "secret": [worker_secret_interceptor(SecretCheck([SECRET])), MalformedRequestInterceptor()]}
    servers = {name: await _server(interceptors) for name, interceptors in variants.items()}
    channels = {name: grpc.aio.insecure_channel(f"127.0.0.1:{port}") for name, (_, port) in servers.items()}
    unary = {name: [] for name in variants}
    stream = {name: [] for name in variants}
    for name, channel in channels.items():  # warm up every channel
        await _unary_us(channel, 50)
        await _stream_msg_us(channel, 50)
    names = list(channels)
    for r in range(args.rounds):  # interleaved: each round times every variant, in an order rotated per round
        for name in names[r % len(names):] + names[:r % len(names)]:
            unary[name].append(await _unary_us(channels[name], args.calls))
            stream[name].append(await _stream_msg_us(channels[name], args.messages))
    for name in variants:
        rows.append({"measure": "unary_us", "server": name, "us": statistics.median(unary[name]),
                     "minus_none_us": statistics.median(u - n for u, n in zip(unary[name], unary["none"]))})
        rows.append({"measure": "stream_msg_us", "server": name, "us": statistics.median(stream[name]),
                     "minus_none_us": statistics.median(s - n for s, n in zip(stream[name], stream["none"]))})
    for channel in channels.values():
        await channel.close()
    for server, _ in servers.values():
        await server.stop(None)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--name", default="auth_check_cpu")
    args = parser.parse_args()
    rows = asyncio.run(main(args))
    print_table(rows, ["measure", "server", "us", "minus_none_us"])
    print(write_results(args.name, rows, {"secret_header": WORKER_SECRET_HEADER}))
