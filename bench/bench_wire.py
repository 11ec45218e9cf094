"""The wire's own cost: the round trip of one small message each way between two processes of this host, per
transport, with an echo on the other side (no model, no round logic):

  raw_tcp          asyncio streams, length-prefixed frames: the floor Python reaches over loopback
  round_channel    services/rpc/round_channel.py (the round's transport: the same frames, hello, checks)
  grpc_stream      one long-lived grpc.aio bidirectional stream (the round's transport before the channel)
Each with and without spinning (the waiting side keeps its event loop turning instead of sleeping in epoll).
The split's goal is stated against this: a round should cost the services no more than its messages' trips.

    python bench/bench_wire.py [--messages 2000] [--bytes 300]
"""

import argparse
import asyncio
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import grpc  # noqa: E402

from bench_common import print_table, write_results  # noqa: E402
from specsplit.services.rpc.round_channel import REQUEST, RoundChannelClient, RoundChannelServer, loop_spinner  # noqa: E402

IDENTITY = lambda b: b  # noqa: E731


class _Bytes:
    """A payload with the protobuf message's two methods the channel uses."""

    def __init__(self, data: bytes):
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data

    @classmethod
    def FromString(cls, data: bytes) -> "_Bytes":
        return cls(data)


async def _serve(kind: str, spin: bool) -> None:
    spinner = loop_spinner() if spin else None
    if kind == "grpc_stream":
        server = grpc.aio.server()

        async def echo(requests, context):
            async for request in requests:
                yield request

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo, IDENTITY, IDENTITY)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
    elif kind == "round_channel":
        async def handle(payload, owner):
            return payload

        server = RoundChannelServer({REQUEST: handle}, spin=False)
        port = await server.start("127.0.0.1", 0)
    else:
        async def echo(reader, writer):
            while True:
                size = struct.unpack("<I", await reader.readexactly(4))[0]
                writer.write(struct.pack("<I", size) + await reader.readexactly(size))

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
    print(port, flush=True)
    if spinner is not None:
        spinner.hold()
    await asyncio.Event().wait()


async def _round_trips(kind: str, port: int, spin: bool, messages: int, size: int) -> list[float]:
    payload = b"x" * size
    spinner = loop_spinner() if spin else None
    if spinner is not None:
        spinner.hold()
    samples = []
    if kind == "grpc_stream":
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call = channel.stream_stream("/bench.Echo/Echo", request_serializer=IDENTITY, response_deserializer=IDENTITY)()
        for _ in range(messages):
            start = time.perf_counter()
            await call.write(payload)
            await call.read()
            samples.append(time.perf_counter() - start)
        call.cancel()
        await channel.close()
    elif kind == "round_channel":
        client = RoundChannelClient("127.0.0.1", port, "bench")
        message = _Bytes(payload)
        for _ in range(messages):
            start = time.perf_counter()
            await client.request(message, _Bytes)
            samples.append(time.perf_counter() - start)
        client.close()
    else:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        frame = struct.pack("<I", size) + payload
        for _ in range(messages):
            start = time.perf_counter()
            writer.write(frame)
            await reader.readexactly(struct.unpack("<I", await reader.readexactly(4))[0])
            samples.append(time.perf_counter() - start)
        writer.close()
    if spinner is not None:
        spinner.release()
    return samples


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        asyncio.run(_serve(sys.argv[2], sys.argv[3] == "1"))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--bytes", type=int, default=300)
    parser.add_argument("--name", default="wire_cpu")
    args = parser.parse_args()
    rows = []
    for kind in ("raw_tcp", "round_channel", "grpc_stream"):
        for spin in (False, True):
            server = subprocess.Popen([sys.executable, __file__, "--serve", kind, "1" if spin else "0"],
                                      stdout=subprocess.PIPE, text=True)
            try:
                port = int(server.stdout.readline())
                samples = sorted(asyncio.run(_round_trips(kind, port, spin, args.messages, args.bytes))[100:])
            finally:
                server.kill()
                server.wait()
            rows.append({"transport": kind, "spin": spin, "round_trip_us_median": round(1e6 * statistics.median(samples), 1),
                         "round_trip_us_p10": round(1e6 * samples[len(samples) // 10], 1),
                         "round_trip_us_p90": round(1e6 * samples[9 * len(samples) // 10], 1)})
            print(rows[-1], flush=True)
    print_table(rows, ["transport", "spin", "round_trip_us_median", "round_trip_us_p10", "round_trip_us_p90"])
    print(f"wrote {write_results(args.name, rows, {'bytes_each_way': args.bytes, 'messages': args.messages, 'load_average': open('/proc/loadavg').read().split()[:3]})}")


if __name__ == "__main__":
    main()
