"""The command channel of a tensor-parallel replica: how rank 0 tells the other ranks which device operation to run
next (runtime/tensor_parallel_runner.py says which operations there are).

A decode step at degree 2 is a few milliseconds of GPU work, and the followers cannot launch it before its command
arrives, so the command's latency is paid on every step. Two channels, chosen by SPECSPLIT_TP_COMMANDS:

- "socket" (the default): one stream socket from rank 0 to each other rank (a Unix socket on one host; TCP to
  SPECSPLIT_TP_HOST where ranks span hosts). A step's command, once per worker call, is a 16-byte header and the
  step's packed int64 inputs as raw bytes: its program, shape and bucket travel once, as a numbered definition, and
  later steps name the number (graph shapes only; an eager step's shape, sized to the exact context, travels with
  it each time). Other commands (prefill forwards, block-table changes) are pickled. On a GPU a
  follower polls its socket without blocking for SPIN seconds after each command (the next step follows within a
  millisecond or two while a replica decodes, and waking a blocked thread costs tens of microseconds), then
  blocks, so an idle replica burns no CPU; on the CPU, where the ranks compute on the cores a poll would take, it
  blocks at once. A socket also reports a lost peer at once: rank 0's send fails when a follower is gone, a
  follower's receive ends when rank 0 is. A follower joins by sending its rank and a random token rank 0 put in
  the replica's store; a connection that does not within JOIN_READ_TIMEOUT_SECONDS, or claims a rank out of range
  or already taken, is closed and rank 0 waits on for the real one.
- "gloo": a broadcast of a pickled frame on a gloo group, the channel before sockets (kept to measure against).
"""

import datetime
import hmac
import logging
import os
import pickle
import socket
import struct
import sys
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

CHANNEL_ENV = "SPECSPLIT_TP_COMMANDS"
SPIN_ENV = "SPECSPLIT_TP_SPIN_SECONDS"
DEFAULT_SPIN_SECONDS = 0.02
# Followers wait for rank 0's next command as long as the replica is idle.
IDLE_TIMEOUT = datetime.timedelta(days=365)
CONNECT_TIMEOUT_SECONDS = 300.0
# A follower says who it is as soon as it connects: a connection that does not within this long is not one.
JOIN_READ_TIMEOUT_SECONDS = 10.0
_JOIN = struct.Struct("<I16s")  # rank, the replica's join token (from the store)
# gloo: a command (its packed inputs and shape) usually fits one frame: one broadcast per operation.
COMMAND_FRAME_BYTES = 4096

_HEADER = struct.Struct("<IIQ")  # kind, step definition number, payload bytes
_PICKLED, _STEP, _DEFINE = 0, 1, 2
# The definition number of an eager step (no bucket): its shape follows the exact context, so it is defined anew
# with each step and never kept (graph shapes are bucketed: a bounded set, each defined once).
_UNBUCKETED = 0xFFFFFFFF


class CommandChannelClosed(RuntimeError):
    """The other end of the command channel is gone: the replica has lost a rank."""


def open_command_channel(rank: int, world_size: int, store, poll: bool, kind: str | None = None):
    """Rank `rank`'s end of its replica's channel (collective: every rank opens it after the model group). `poll`:
    followers poll for the next command before blocking (GPU replicas)."""
    kind = kind or os.environ.get(CHANNEL_ENV, "socket")
    if kind == "socket":
        spin = float(os.environ.get(SPIN_ENV, DEFAULT_SPIN_SECONDS)) if poll else 0.0
        return SocketCommands(rank, world_size, dist.PrefixStore("commands", store), spin)
    if kind == "gloo":
        return GlooCommands(rank, world_size, dist.PrefixStore("command", store))
    raise ValueError(f"{CHANNEL_ENV} must be 'socket' or 'gloo', not {kind!r}")


class SocketCommands:
    def __init__(self, rank: int, world_size: int, store, spin_seconds: float):
        self.rank = rank
        self.spin_seconds = spin_seconds
        self._defined: dict[tuple, int] = {}     # rank 0: step definitions sent
        self._definitions: dict[int, tuple] = {}  # followers: step definitions received
        self._header = bytearray(_HEADER.size)
        self._last_command = time.monotonic()
        if rank == 0:
            self.peers = _accept_followers(world_size, store)
        else:
            self.peers = {0: _connect_to_driver(rank, store)}

    # -- rank 0 ------------------------------------------------------------------------------------------------------

    def send(self, command: tuple) -> None:
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        self._send_all(_HEADER.pack(_PICKLED, 0, len(payload)) + payload)

    def send_step(self, name: str, shape, rows: int, host: np.ndarray, bucket: int | None) -> None:
        """A step program's command: its inputs as raw bytes, its program, shape and bucket by number (an eager
        step's definition comes with it every time)."""
        key = (name, shape, rows, bucket)
        number = self._defined.get(key)
        frames = b""
        if number is None:
            number = _UNBUCKETED if bucket is None else self._defined.setdefault(key, len(self._defined))
            definition = pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)
            frames = _HEADER.pack(_DEFINE, number, len(definition)) + definition
        data = np.ascontiguousarray(host, dtype=np.int64).tobytes()
        self._send_all(frames + _HEADER.pack(_STEP, number, len(data)) + data)  # one write: one wake-up

    def _send_all(self, frame: bytes) -> None:
        for rank, peer in self.peers.items():
            try:
                peer.sendall(frame)
            except OSError as error:
                raise CommandChannelClosed(f"tensor-parallel rank {rank} closed its command connection ({error})") from None

    # -- ranks > 0 ---------------------------------------------------------------------------------------------------

    def receive(self) -> tuple:
        """Block until rank 0 sends the next command; a step comes back as ("step", name, shape, rows, host,
        bucket), host an int64 array."""
        while True:
            self._receive_into(memoryview(self._header), spin=True)
            kind, number, size = _HEADER.unpack(self._header)
            payload = bytearray(size)
            self._receive_into(memoryview(payload), spin=False)
            self._last_command = time.monotonic()
            if kind == _DEFINE:  # an eager step's replaces the previous one's (_UNBUCKETED)
                self._definitions[number] = pickle.loads(payload)
            elif kind == _STEP:
                name, shape, rows, bucket = self._definitions[number]
                return "step", name, shape, rows, np.frombuffer(payload, dtype=np.int64), bucket
            else:
                return pickle.loads(payload)

    def _receive_into(self, view: memoryview, spin: bool) -> None:
        driver = self.peers[0]
        spin_until = self._last_command + self.spin_seconds if spin else 0.0
        got = 0
        while got < len(view):
            if time.monotonic() < spin_until:
                try:
                    n = driver.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
            else:
                n = driver.recv_into(view[got:])
            if n == 0:
                raise CommandChannelClosed("tensor-parallel rank 0 closed the command channel")
            got += n

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()


def _accept_followers(world_size: int, store) -> dict[int, socket.socket]:
    host = os.environ.get("SPECSPLIT_TP_HOST")
    if host:  # ranks on other hosts reach this one over TCP
        listener = socket.create_server((host, 0))
        address = f"tcp:{host}:{listener.getsockname()[1]}"
    else:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"specsplit-tp-{uuid.uuid4().hex}"
        path = "\0" + name if sys.platform.startswith("linux") else os.path.join(_socket_dir(), name)
        listener.bind(path)
        address = "unix:" + path
    listener.listen(max(world_size, 16))
    token = os.urandom(16)  # only processes that can read the replica's store know it
    store.set("token", token)
    store.set("address", address)
    deadline = time.monotonic() + CONNECT_TIMEOUT_SECONDS
    peers = {}
    try:
        while len(peers) < world_size - 1:
            listener.settimeout(max(deadline - time.monotonic(), 0.001))
            connection, _ = listener.accept()
            rank = _joining_rank(connection, token, world_size, peers, deadline)
            if rank is None:  # not a follower of this replica (or a second one claiming a rank): not let in
                connection.close()
                continue
            connection.settimeout(None)
            _no_delay(connection)
            peers[rank] = connection
    finally:
        listener.close()
        if address.startswith("unix:") and not address.startswith("unix:\0"):
            os.unlink(address[len("unix:"):])
    return dict(sorted(peers.items()))


def _joining_rank(connection: socket.socket, token: bytes, world_size: int, peers: dict,
                  deadline: float) -> int | None:
    """The rank a new connection joins as, or None (it said nothing in time, not the token, or a rank that is out
    of range or taken). A silent connection waits no longer than the followers' deadline: connections that say
    nothing cannot keep the followers out past it, one read bound after another."""
    connection.settimeout(max(min(JOIN_READ_TIMEOUT_SECONDS, deadline - time.monotonic()), 0.001))
    try:
        rank, sent = _JOIN.unpack(_read_exactly(connection, _JOIN.size))
    except (OSError, CommandChannelClosed) as error:  # socket.timeout is an OSError
        log.warning("tensor-parallel command channel: a connection did not join (%s)", error)
        return None
    if not hmac.compare_digest(sent, token) or not 0 < rank < world_size or rank in peers:
        log.warning("tensor-parallel command channel: refused a connection joining as rank %d", rank)
        return None
    return rank


def _connect_to_driver(rank: int, store) -> socket.socket:
    address = store.get("address").decode()
    token = store.get("token")
    if address.startswith("tcp:"):
        _, host, port = address.split(":")
        connection = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_SECONDS)
    else:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Blocking: with a timeout set, a Unix socket whose backlog is full refuses at once (EAGAIN) instead of
        # waiting for rank 0 to accept the connections ahead (a stranger's among them).
        connection.connect(address[len("unix:"):])
    connection.settimeout(None)
    _no_delay(connection)
    connection.sendall(_JOIN.pack(rank, token))
    return connection


def _no_delay(connection: socket.socket) -> None:
    if connection.family in (socket.AF_INET, socket.AF_INET6):
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise CommandChannelClosed("a tensor-parallel rank closed its command connection while joining")
        data += chunk
    return data


def _socket_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


class GlooCommands:
    """Rank 0 broadcasts each command, pickled, in a fixed-size frame (its first 8 bytes the payload's length); a
    payload larger than the frame sends its rest in a second broadcast."""

    def __init__(self, rank: int, world_size: int, store):
        from specsplit.services.runtime.tensor_parallel_group import gloo_group

        self.rank = rank
        self.group = gloo_group(store, rank, world_size, IDLE_TIMEOUT)

    def send(self, command: tuple) -> None:
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        frame = torch.zeros(COMMAND_FRAME_BYTES, dtype=torch.uint8)
        frame[:8] = torch.frombuffer(bytearray(len(payload).to_bytes(8, "little")), dtype=torch.uint8)
        head = payload[: COMMAND_FRAME_BYTES - 8]
        frame[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self.group.broadcast([frame], dist.BroadcastOptions()).wait()
        if len(payload) > len(head):
            rest = torch.frombuffer(bytearray(payload[len(head):]), dtype=torch.uint8)
            self.group.broadcast([rest], dist.BroadcastOptions()).wait()

    def send_step(self, name: str, shape, rows: int, host: np.ndarray, bucket: int | None) -> None:
        self.send(("step", name, shape, rows, host, bucket))

    def receive(self) -> tuple:
        frame = torch.empty(COMMAND_FRAME_BYTES, dtype=torch.uint8)
        self.group.broadcast([frame], dist.BroadcastOptions()).wait()
        raw = frame.numpy().tobytes()
        size = int.from_bytes(raw[:8], "little")
        payload = raw[8 : 8 + size]
        if size > len(payload):
            rest = torch.empty(size - len(payload), dtype=torch.uint8)
            self.group.broadcast([rest], dist.BroadcastOptions()).wait()
            payload += rest.numpy().tobytes()
        return pickle.loads(payload)

    def close(self) -> None:
        pass
