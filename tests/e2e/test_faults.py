"""Faults with real processes: a draft or target replica killed mid-stream loses no request and changes no
greedy output; a restarted worker is used again; a dead coordinator gives UNAVAILABLE and its sequences' KV is
freed by the workers' leases."""

import asyncio
import signal
import threading
import time

import grpc
import pytest

from specsplit.client import Client
from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.service_commands import spawn_service
from cluster import Cluster, free_port

PROMPTS = ["def add(a, b):", "hello world", "import os\n", "1 2 3 4", "class A:", "while True:"]
MAX_TOKENS = 250


@pytest.fixture(scope="module")
def reference(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype="float64")

    async def main():
        return [await engine.generate(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]

    return [r.token_ids for r in asyncio.run(main())]


@pytest.fixture(scope="module")
def faulty(tiny_pair):
    c = Cluster()
    c.worker_argv = {}
    for name, role, model in [("target_a", "target", "target"), ("target_b", "target", "target"),
                              ("draft_a", "draft", "close"), ("draft_b", "draft", "close")]:
        c.worker_argv[name] = [role, "--model", str(tiny_pair[model]), "--host", "127.0.0.1", "--port", str(free_port()),
                               "--dtype", "float64", "--lease-seconds", "4", "--metrics-port", "-1",
                               "--num-kv-blocks", "512"]
    try:
        c.start(dict(c.worker_argv))
        a = c.addresses
        c.start({"coordinator": ["coordinator", "--target", f"{a['target_a']},{a['target_b']}", "--draft", f"{a['draft_a']},{a['draft_b']}",
                                 "--host", "127.0.0.1", "--port", "0", "-k", "4", "--speculation", "fixed", "--metrics-port", "-1", "--replica-recovery-seconds", "30"]})
        yield c
    finally:
        c.stop()


def stream_all(address: str, started: threading.Barrier | None = None):
    """One stream per prompt, concurrently; returns each stream's tokens or the error that ended it."""
    results = [None] * len(PROMPTS)

    def run(i):
        tokens = []
        try:
            with Client(address, timeout=120) as client:
                for n, chunk in enumerate(client.generate_stream(PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True)):
                    tokens.extend(chunk.token_ids)
                    if n == 0 and started is not None:
                        started.wait()
            results[i] = tokens
        except grpc.RpcError as error:
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    return threads, results


def kill_mid_stream(cluster, victim: str, address: str):
    started = threading.Barrier(len(PROMPTS) + 1)
    threads, results = stream_all(address, started)
    started.wait(timeout=120)
    cluster.processes[victim].send_signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=180)
    return results


def restart(cluster, name):
    cluster.processes[name].wait(timeout=30)
    process, address = spawn_service(cluster.worker_argv[name])
    cluster.processes[name] = process
    assert address == cluster.addresses[name]


def test_draft_killed_mid_stream_loses_nothing(faulty, reference):
    results = kill_mid_stream(faulty, "draft_a", faulty.addresses["coordinator"])
    assert results == reference  # every request completed, with exactly the fault-free greedy output
    restart(faulty, "draft_a")
    before = faulty.worker_info("draft_a").sequences_prefilled
    deadline = time.monotonic() + 60
    with Client(faulty.addresses["coordinator"], timeout=60) as client:
        while faulty.worker_info("draft_a").sequences_prefilled == before and time.monotonic() < deadline:
            client.generate("again", max_tokens=8)
    assert faulty.worker_info("draft_a").sequences_prefilled > before  # the coordinator reconnected on its own


def test_target_killed_mid_stream_is_reprefilled_elsewhere(faulty, reference):
    results = kill_mid_stream(faulty, "target_a", faulty.addresses["coordinator"])
    assert results == reference
    restart(faulty, "target_a")
    infos = faulty.wait_kv_free(["target_a", "target_b", "draft_a", "draft_b"])
    assert all(i.kv_blocks_used == 0 for i in infos.values())


def test_coordinator_killed_gives_unavailable_and_leases_free_kv(faulty):
    results = kill_mid_stream(faulty, "coordinator", faulty.addresses["coordinator"])
    assert all(isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.UNAVAILABLE for r in results)
    infos = faulty.wait_kv_free(["target_a", "target_b", "draft_a", "draft_b"], timeout=30)
    assert {n: (i.kv_blocks_used, i.sequences) for n, i in infos.items()} == {n: (0, 0) for n in infos}
