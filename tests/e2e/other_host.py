"""Another host, for tests of what a service shows on the network: a network namespace joined to this one by a veth
pair. This machine gets a non-loopback address on its end of the pair, whatever its own network, and probes run from
inside the namespace, as from another machine on the link.

Making one needs root and iproute2 (`ip`); without them the machine's own non-loopback address is used, probed from
here (a listener on 127.0.0.1 refuses it all the same); with neither, `connected_host()` skips the test and says why:
a test that cannot look from outside must not pass as if it had.
"""

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
from contextlib import contextmanager

import pytest

NETWORK = ipaddress.ip_network("198.18.0.0/15")  # reserved for network tests (RFC 2544): not anyone's real network

# Run inside the namespace: connect to HOST:PORT and, given a path, GET it. "refused" means the host answered that
# nothing listens there for this address; no answer at all is another outcome, so a broken link cannot pass for it.
_PROBE = """
import socket, sys, urllib.request
host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    socket.create_connection((host, port), timeout=10).close()
except ConnectionRefusedError:
    print("refused")
except OSError as error:
    print(f"unreachable: {error}")
else:
    print(urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10).status if path else "open")
"""


class OtherHost:
    """`address`: this machine's non-loopback address; `reach(port, path)`: what a client elsewhere gets there."""

    def __init__(self, address: str, namespace: str | None):
        self.address = address
        self.namespace = namespace  # None: probes run from this machine itself

    def reach(self, port: int, path: str = "") -> str:
        """"refused", "open" or (given a path) the HTTP status of GET path, as a string; "unreachable: ..." if the
        host did not answer."""
        command = [sys.executable, "-c", _PROBE, self.address, str(port), path]
        if self.namespace:
            command = ["ip", "netns", "exec", self.namespace, *command]
        return subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout.strip()


@contextmanager
def connected_host():
    namespace = f"specsplit-peer-{os.getpid()}"
    if os.geteuid() == 0 and shutil.which("ip"):
        try:
            address = _make_peer(namespace)
        except subprocess.CalledProcessError as error:
            _remove_peer(namespace)
            reason = f"no network namespace could be made ({error.stderr.strip()})"
        else:
            try:
                yield OtherHost(address, namespace)
            finally:
                _remove_peer(namespace)
            return
    else:
        reason = "making a network namespace needs root and iproute2 (ip)"
    address = _own_non_loopback_address()
    if address is None:
        pytest.skip(f"cannot look from another host: this machine has no non-loopback address and {reason}")
    yield OtherHost(address, None)


def _make_peer(namespace: str) -> str:
    """The namespace, a veth pair between it and here, an address on each end; returns this end's address."""
    here, there = _free_pair()
    host_end, peer_end = f"spv{os.getpid()}h", f"spv{os.getpid()}p"
    for command in (
        ["ip", "netns", "add", namespace],
        ["ip", "link", "add", host_end, "type", "veth", "peer", "name", peer_end, "netns", namespace],
        ["ip", "addr", "add", f"{here}/30", "dev", host_end],
        ["ip", "link", "set", host_end, "up"],
        ["ip", "-n", namespace, "addr", "add", f"{there}/30", "dev", peer_end],
        ["ip", "-n", namespace, "link", "set", peer_end, "up"],
        ["ip", "-n", namespace, "link", "set", "lo", "up"],
    ):
        subprocess.run(command, capture_output=True, text=True, check=True)
    return str(here)


def _free_pair() -> tuple[ipaddress.IPv4Address, ipaddress.IPv4Address]:
    """Two addresses of a /30 in NETWORK that no interface here uses (tests running side by side make their own)."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    blocks = list(NETWORK.subnets(new_prefix=30))
    start = os.getpid() % len(blocks)
    for block in blocks[start:] + blocks[:start]:
        here, there = list(block.hosts())
        if f" {here}/" not in used and f" {there}/" not in used:
            return here, there
    raise RuntimeError(f"every /30 of {NETWORK} is in use")


def _remove_peer(namespace: str) -> None:
    # Deleting the namespace deletes its end of the pair, and with it this end.
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _own_non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address
