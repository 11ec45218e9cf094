"""Real service processes on loopback for end-to-end tests: workers and coordinators started with the CLI."""

import os
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from specsplit.proto.v1 import worker_pb2, worker_pb2_grpc
from specsplit.services.service_commands import printed, spawn_service, stop_processes
from metrics_page import scrape  # noqa: F401  (the tests import it from here too)


def free_port() -> int:
    """A loopback port free now (for a worker that must come back on the same address after a restart)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (every thread's children, read from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out

class Cluster:
    def __init__(self):
        self.processes: dict[str, subprocess.Popen] = {}
        self.addresses: dict[str, str] = {}

    def start(self, specs: dict[str, list[str]], env: dict[str, str] | None = None) -> None:
        """Start named services in parallel: {name: specsplit argv}, with `env` added to this process's."""
        environment = {**os.environ, **env} if env else None
        with ThreadPoolExecutor(len(specs)) as pool:
            starts = {name: pool.submit(spawn_service, argv, environment) for name, argv in specs.items()}
        failures = []
        for name, start in starts.items():
            try:
                self.processes[name], self.addresses[name] = start.result()
            except Exception as error:  # the others started: kept, so that stop() stops them
                failures.append(error)
        if failures:
            raise failures[0]

    def metrics_url(self, name: str) -> str:
        """http://HOST:PORT of a service started with --metrics-port (it prints where before listening)."""
        return self._printed(name, " metrics on ", "metrics").removesuffix("/metrics")

    def http_url(self, name: str) -> str:
        """The OpenAI API's base URL (http://HOST:PORT/v1) of a coordinator started with --http-port."""
        return self._printed(name, " OpenAI API on ", "HTTP API")

    def _printed(self, name: str, marker: str, what: str) -> str:
        url = printed(self.processes[name].startup_lines, marker)
        if url is None:
            raise LookupError(f"{name} serves no {what}")
        return url

    def worker_info(self, name: str) -> worker_pb2.WorkerInfo:
        with grpc.insecure_channel(self.addresses[name]) as channel:
            is_draft = name.startswith("draft")
            stub = worker_pb2_grpc.DraftWorkerStub(channel) if is_draft else worker_pb2_grpc.TargetWorkerStub(channel)
            return stub.Describe(worker_pb2.DescribeRequest(), timeout=10)

    def wait_kv_free(self, names, timeout: float = 15.0) -> dict:
        """Poll until every named worker holds no sequences and no KV blocks; returns the last infos."""
        deadline = time.monotonic() + timeout
        while True:
            infos = {n: self.worker_info(n) for n in names}
            if all(i.kv_blocks_used == 0 and i.sequences == 0 for i in infos.values()) or time.monotonic() > deadline:
                return infos
            time.sleep(0.2)

    def stop(self) -> None:
        stop_processes(self.processes.values(), timeout=10)


def generate_concurrently(address: str, prompts: list[str], max_tokens: int, timeout: float = 120, **params) -> list:
    """Every prompt as its own client's request at once (ignore_eos), through the coordinator at `address`."""
    from specsplit.client import Client

    def one(prompt):
        with Client(address, timeout=timeout) as client:
            return client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, **params)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def item_codes(response) -> list[int]:
    """Per sequence of a batched worker response (columnar: ProposeResponse, VerifyResponse), its status code
    number: 0 where it succeeded."""
    codes = [0] * len(response.counts)
    for error in response.errors:
        codes[error.index] = error.status.code
    return codes


def item_tokens(response) -> list[list[int]]:
    """Per sequence of a batched worker response, the tokens it returned (proposed or emitted)."""
    out, start = [], 0
    for count in response.counts:
        out.append(list(response.token_ids[start : start + count]))
        start += count
    return out
