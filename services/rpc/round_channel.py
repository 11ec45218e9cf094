"""The round channel: a worker's round call (Propose on a draft, Verify on a target) and its prefills as
length-prefixed protobuf frames over one plain TCP (or TLS) connection per coordinator, beside the worker's gRPC
server.

Why: the round is the one exchange whose latency the split pays every step, and a gRPC message in Python crosses
three or four threads on each side (the transport's I/O threads, grpc.aio's completion-queue poller, the event
loop), each a wake-up that costs tens to hundreds of microseconds on a virtualised host. Here a frame is read by
the event loop straight off the socket: one wake-up per message, and none at all while the waiting side spins
(`spin_wait`, below). A request's first token waits on its prefill, so prefills take the channel too (over gRPC
a first token came 1.0 ms later on the 2-core CPU: BENCHMARKS.md, bench_split_breakdown.py). The messages are
the gRPC ones (worker.proto), so both transports share their code and checks; everything else (release, describe,
health) stays on gRPC, which also says where the channel listens (WorkerInfo.round_port).

Frames: a 5-byte header (little-endian uint32 payload length, one byte kind) and the payload.
- HELLO (client, first frame): "coordinator id\\n worker secret" in UTF-8 (the secret empty where none is
  set), at most MAX_HELLO_BYTES. A worker with a secret checks it as it checks gRPC calls (caller_auth.SecretCheck,
  same throttle) before anything else: a wrong one, or a first frame that is no hello, is answered with an ERROR
  frame (UNAUTHENTICATED) after the throttle's delay, and the connection closes.
  TLS and mutual TLS are the worker's gRPC settings, on this socket too.
- REQUEST / RESPONSE: one serialized round request message (ProposeRequest, VerifyRequest), answered by one
  response message, in order.
- PREFILL / RESPONSE: one serialized prefill request (DraftPrefillRequest, TargetPrefillRequest), answered the same
  way by the Prefill method's response message.
- ERROR: a google.rpc code (4 bytes) and a message; the worker closes the connection after sending one (bytes
  that do not parse, columns that do not line up: the caller's bug, as a gRPC stream would end).
"""

import asyncio
import logging
import os
import socket
import ssl
import struct
import weakref

import grpc

from specsplit.services.errors import InvalidArgument, SpecsplitError, Unavailable
from specsplit.services.rpc.server import MAX_MESSAGE_BYTES
from specsplit.services.rpc.status_codes import code_number, error_from_status, status_code_for
from specsplit.services.rpc.step_batcher import compute_threads_busy
from specsplit.services.rpc.worker_credentials import MAX_OWNER_BYTES, checked_owner

log = logging.getLogger(__name__)

HEADER = struct.Struct("<IB")
HELLO, REQUEST, RESPONSE, ERROR, PREFILL = 1, 2, 3, 4, 5
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES  # as gRPC's message limit
MAX_HELLO_BYTES = 4096               # read before the caller is authenticated: an id and a secret, no more
UNAUTHENTICATED = code_number(grpc.StatusCode.UNAUTHENTICATED)
INTERNAL = code_number(grpc.StatusCode.INTERNAL)
HELLO_SECONDS = 10.0                # a connection that says nothing is dropped
SPIN_AFTER_ANSWER_SECONDS = 0.05    # a spinning worker keeps its loop hot this long after each answer
YIELD_SECONDS = 0.0005              # how a spinning loop waits while a compute thread needs the GIL


def encode_frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME_BYTES) -> tuple[int, bytes]:
    size, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > limit:
        raise InvalidArgument(f"a frame of {size} bytes is over the {limit}-byte limit")
    return kind, await reader.readexactly(size)


def error_frame(code: int, message: str) -> bytes:
    return encode_frame(ERROR, struct.pack("<I", code) + message.encode()[:1024])


def error_from_frame(payload: bytes) -> Exception:
    (code,) = struct.unpack("<I", payload[:4])
    message = payload[4:].decode(errors="replace")
    if code == UNAUTHENTICATED:  # waiting will not help: no replica to fail over to on this one
        return Unavailable(f"the worker refused the round channel: {message}")
    return error_from_status(code, message)


CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD", or "max PERIOD" where unlimited


def cgroup_cpu_quota(path: str) -> float | None:
    """The cores this process's cgroup may use (a container's CPU limit), or None where it sets none or cannot
    be read. The CPU affinity does not show it: in a container it lists the node's CPUs."""
    try:
        with open(path) as file:
            quota, period = file.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def spin_wait_default(on_accelerator: bool) -> bool:
    """Spinning costs a core while a reply is awaited: worth it where the model computes on an accelerator (the host
    cores are free) and where at least four cores leave room; never on a small machine whose cores compute, nor in
    a container limited to fewer (its CPU quota, which the affinity does not show)."""
    try:
        cores: float = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(CGROUP_CPU_MAX)
    if quota is not None:
        cores = min(cores, quota)
    return on_accelerator and cores >= 4


def loop_spinner() -> "LoopSpinner":
    """The running event loop's one spinner: every client and server of the loop holds the same one, so one task
    spins however many channels wait."""
    loop = asyncio.get_running_loop()
    spinner = _SPINNERS.get(loop)
    if spinner is None:
        spinner = _SPINNERS[loop] = LoopSpinner()
    return spinner


class LoopSpinner:
    """Keeps an event loop from sleeping while someone waits for a round message: the loop turns over with a zero
    timeout (other tasks still run), so the message is read the moment it lands instead of after a thread wake-up.
    Never while a compute thread of the process runs a step (a prefill): spinning holds the GIL nearly all the time
    and would starve that thread's host work; the loop then polls every half millisecond instead."""

    def __init__(self):
        self._holders = 0
        self._until = 0.0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def hold(self, seconds: float | None = None) -> None:
        """Spin until `release` (or, with `seconds`, for that long from now)."""
        loop = asyncio.get_running_loop()
        if seconds is None:
            self._holders += 1
        else:
            self._until = max(self._until, loop.time() + seconds)
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._spin())
        self._wake.set()

    def release(self) -> None:
        self._holders = max(0, self._holders - 1)

    async def _spin(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._holders == 0 and loop.time() >= self._until:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(YIELD_SECONDS if compute_threads_busy() else 0)


_SPINNERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopSpinner]" = weakref.WeakKeyDictionary()


class RoundChannelServer:
    """Serves a worker's calls by frame kind: `handlers[kind](payload, owner)` -> response bytes (raises
    SpecsplitError); REQUEST (the round's call) and PREFILL where the worker serves them."""

    def __init__(self, handlers: dict, check=None, ssl_context: ssl.SSLContext | None = None, spin: bool = False):
        self._handlers = handlers
        self._check = check  # caller_auth.SecretCheck of the worker's secret, or None (no secret)
        self._ssl = ssl_context
        self._spin = spin
        self._server = None
        self._connections: set = set()

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port, ssl=self._ssl, limit=1 << 20)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.close()
            await self._server.wait_closed()

    async def _serve(self, reader, writer) -> None:
        _no_delay(writer)
        address = (writer.get_extra_info("peername") or ("?",))[0]
        self._connections.add(writer)
        try:
            owner = await asyncio.wait_for(self._hello(reader, address), HELLO_SECONDS)
            if owner is None:
                writer.write(error_frame(UNAUTHENTICATED, "missing or invalid worker secret"))
                return
            while True:
                kind, payload = await read_frame(reader)
                handle = self._handlers.get(kind)
                if handle is None:
                    raise InvalidArgument(f"expected a request or prefill frame, got kind {kind}")
                try:
                    response = await handle(payload, owner)
                except SpecsplitError as error:
                    writer.write(error_frame(code_number(status_code_for(error)), str(error)))
                    log.warning("round channel from %s ended: %s", address, error)
                    return
                except Exception as error:  # a worker bug: reported as gRPC reports it (INTERNAL), not as a lost
                    writer.write(error_frame(INTERNAL, type(error).__name__))  # replica the caller fails over from
                    log.exception("round channel from %s: the round call failed", address)
                    return
                writer.write(encode_frame(RESPONSE, response))
                if self._spin:
                    loop_spinner().hold(SPIN_AFTER_ANSWER_SECONDS)  # the next round's request comes soon
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, asyncio.CancelledError):
            return  # the coordinator went away or said nothing, or this worker stops: nothing to answer
        except InvalidArgument as error:
            writer.write(error_frame(code_number(status_code_for(error)), str(error)))
            log.warning("round channel from %s refused: %s", address, error)
        finally:
            self._connections.discard(writer)
            writer.close()

    async def _hello(self, reader, address: str) -> str | None:
        """The caller's coordinator id once it proved it knows the secret (where one is set); None when it did not.
        As gRPC checks the secret before it reads a message, so here: where a secret is set, a first frame that is
        no hello (another kind, over the hello's small limit) is a failed secret, throttled like one and never
        logged per connection; the id is checked only after the secret."""
        try:
            kind, payload = await read_frame(reader, MAX_HELLO_BYTES)
            if kind != HELLO:
                raise InvalidArgument("the first frame must be a hello")
        except InvalidArgument:
            if self._check is None:
                raise
            await self._check.refuse(address)
            return None
        owner, _, secret = payload.partition(b"\n")
        if self._check is not None and not self._check.valid(secret):
            await self._check.refuse(address)
            return None
        try:
            owner = checked_owner(owner.decode())  # the bound the gRPC calls get (worker_credentials.caller_owner)
        except UnicodeDecodeError:
            owner = None
        if owner is None:
            raise InvalidArgument(f"coordinator id must be UTF-8 of at most {MAX_OWNER_BYTES} bytes")
        return owner


class RoundChannelClient:
    """One coordinator's connection to a worker's round channel; requests go one at a time, each answered in
    order. A broken connection raises Unavailable and is reopened by the next request."""

    def __init__(self, host: str, port: int, owner: str, secret: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, server_hostname: str | None = None, spin: bool = False):
        self.host, self.port = host, port
        self._hello = encode_frame(HELLO, f"{owner}\n{secret or ''}".encode())
        self._ssl, self._server_hostname = ssl_context, server_hostname
        self._spin = spin
        self._lock = asyncio.Lock()
        self._reader = self._writer = None

    async def request(self, message, response_type, kind: int = REQUEST):
        """Send `message` (a protobuf request) in a frame of `kind` (REQUEST, PREFILL), return the `response_type`
        message that answers it."""
        async with self._lock:
            spinner = loop_spinner() if self._spin else None
            if spinner is not None:
                spinner.hold()
            try:
                if self._writer is None:
                    await self._connect()
                self._writer.write(encode_frame(kind, message.SerializeToString()))
                kind, payload = await read_frame(self._reader)
            except (OSError, asyncio.IncompleteReadError) as error:
                self._close()
                raise Unavailable(f"round channel to {self.host}:{self.port} broke: {error}") from None
            except BaseException:  # cancelled (the caller's deadline) mid-exchange: the stream is out of step now
                self._close()
                raise
            finally:
                if spinner is not None:
                    spinner.release()
            if kind == ERROR:
                self._close()
                raise error_from_frame(payload)
            if kind != RESPONSE:
                self._close()
                raise Unavailable(f"round channel to {self.host}:{self.port} sent a frame of kind {kind}")
            return response_type.FromString(payload)

    async def _connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(
            self.host, self.port, ssl=self._ssl, server_hostname=self._server_hostname if self._ssl else None,
            limit=1 << 20)
        _no_delay(self._writer)
        self._writer.write(self._hello)

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    def close(self) -> None:
        self._close()


def server_ssl_context(security) -> ssl.SSLContext | None:
    """The worker's gRPC TLS settings (rpc/security.ServerSecurity) for the round channel's socket."""
    if security is None or not security.cert_file:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(security.cert_file, security.key_file)
    if security.client_ca_file:
        context.load_verify_locations(security.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(security) -> ssl.SSLContext | None:
    """The coordinator's worker TLS settings (rpc/security.ChannelSecurity) for the round channel."""
    if security is None or not security.enabled:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if security.ca_file:
        context.load_verify_locations(security.ca_file)
    if security.cert_file:
        context.load_cert_chain(security.cert_file, security.key_file)
    return context


def _no_delay(writer) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
