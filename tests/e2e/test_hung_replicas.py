"""Hung replicas with real processes: a target or draft frozen with SIGSTOP under load costs the other streams about
a second, not the transport's minute. Its sequences move on (target: re-prefilled on the other target; draft:
target-only), every greedy output stays identical to the target's alone, and once it is resumed (SIGCONT) it is
told which sequences moved away, so KV on every worker returns to zero although the workers' leases are long."""

import asyncio
import signal
import threading
import time

import grpc
import pytest

from specsplit.client import Client
from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from cluster import Cluster, free_port

PROMPTS = ["def add(a, b):", "hello world", "import os\n", "1 2 3 4", "class A:", "while True:"]
MAX_TOKENS = 500  # about the tiny models' whole context (512)
FREEZE_SECONDS = 6.0  # twice MAX_GAP_SECONDS: a stream that waits for the frozen replica fails the test
MAX_GAP_SECONDS = 3.0  # the hung-call floor is 1 s; the rest is re-prefill and scheduling on a loaded CI host
WORKERS = ["target_a", "target_b", "draft"]


@pytest.fixture(scope="module")
def reference(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype="float64")

    async def main():  # one batch: greedy output does not depend on what else is batched
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))

    return [r.token_ids for r in asyncio.run(main())]


@pytest.fixture(scope="module")
def frozen_cluster(tiny_pair):
    """Two targets and one draft with the default (600 s) lease, so only the coordinator's releases free KV."""
    c = Cluster()
    worker = ["--host", "127.0.0.1", "--dtype", "float64", "--metrics-port", "-1", "--num-kv-blocks", "512"]
    try:
        c.start({
            "target_a": ["target", "--model", str(tiny_pair["target"]), "--port", str(free_port()), *worker],
            "target_b": ["target", "--model", str(tiny_pair["target"]), "--port", str(free_port()), *worker],
            "draft": ["draft", "--model", str(tiny_pair["close"]), "--port", str(free_port()), *worker],
        })
        a = c.addresses
        c.start({"coordinator": ["coordinator", "--target", f"{a['target_a']},{a['target_b']}", "--draft", a["draft"],
                                 "--host", "127.0.0.1", "--port", "0", "-k", "4", "--speculation", "fixed",
                                 "--metrics-port", "-1"]})
        yield c
    finally:
        for process in c.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        c.stop()


def freeze_under_load(cluster, victim: str):
    """Stream every prompt at once; freeze `victim` once all have started, resume it FREEZE_SECONDS later.
    Returns per stream (tokens or error, arrival times of its chunks) and the freeze window."""
    started = threading.Barrier(len(PROMPTS) + 1)
    results = [None] * len(PROMPTS)
    arrivals = [[] for _ in PROMPTS]

    def run(i):
        tokens = []
        try:
            with Client(cluster.addresses["coordinator"], timeout=120) as client:
                for n, chunk in enumerate(client.generate_stream(PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True)):
                    tokens.extend(chunk.token_ids)
                    if chunk.token_ids:
                        arrivals[i].append(time.monotonic())
                    if n == 0:
                        started.wait()
            results[i] = tokens
        except grpc.RpcError as error:
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    started.wait(timeout=120)
    time.sleep(0.3)  # every stream decoding, its calls' times measured
    cluster.processes[victim].send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    time.sleep(FREEZE_SECONDS)
    cluster.processes[victim].send_signal(signal.SIGCONT)
    resumed_at = time.monotonic()
    for t in threads:
        t.join(timeout=180)
    return results, arrivals, (frozen_at, resumed_at)


def longest_gap(times: list[float], until: float) -> float:
    """The longest wait between chunks of a stream (or from its last chunk to `until` if it was still running)."""
    return max(b - a for a, b in zip(times, times[1:] + [until]))


def check_streams_kept_going(results, arrivals, window, reference):
    frozen_at, resumed_at = window
    assert results == reference  # every request completed, with exactly the target-only greedy output
    finished = [times[-1] for times in arrivals]
    print(f"streams ended {', '.join(f'{f - resumed_at:+.1f}' for f in finished)} s after the resume")
    assert sum(f > frozen_at + 1.2 for f in finished) >= len(PROMPTS) // 2, "the freeze must fall mid-stream"
    gaps = [longest_gap([t for t in times if t >= frozen_at - 1.0], min(f, resumed_at)) for times, f in zip(arrivals, finished)]
    assert max(gaps) < MAX_GAP_SECONDS, gaps  # no stream stalled for the frozen replica (60 s before)
    # Tokens kept coming while the replica was still frozen, after it had been found hung.
    during = sum(frozen_at + 1.2 <= t <= resumed_at for times in arrivals for t in times)
    assert during > 0
    return max(gaps)


def test_frozen_target_costs_about_a_second_and_its_kv_is_released_when_it_resumes(frozen_cluster, reference):
    results, arrivals, window = freeze_under_load(frozen_cluster, "target_a")
    gap = check_streams_kept_going(results, arrivals, window, reference)
    infos = frozen_cluster.wait_kv_free(WORKERS, timeout=15)
    assert {n: (i.kv_blocks_used, i.sequences) for n, i in infos.items()} == {n: (0, 0) for n in WORKERS}
    print(f"frozen target: longest gap {gap:.2f} s")


def test_frozen_draft_decodes_target_only_and_is_used_again(frozen_cluster, reference):
    results, arrivals, window = freeze_under_load(frozen_cluster, "draft")
    gap = check_streams_kept_going(results, arrivals, window, reference)
    infos = frozen_cluster.wait_kv_free(WORKERS, timeout=15)
    assert {n: (i.kv_blocks_used, i.sequences) for n, i in infos.items()} == {n: (0, 0) for n in WORKERS}
    # The coordinator probes the resumed draft and speculates with it again.
    before = frozen_cluster.worker_info("draft").sequences_prefilled
    deadline = time.monotonic() + 30
    with Client(frozen_cluster.addresses["coordinator"], timeout=60) as client:
        while frozen_cluster.worker_info("draft").sequences_prefilled == before and time.monotonic() < deadline:
            client.generate("again", max_tokens=8)
    assert frozen_cluster.worker_info("draft").sequences_prefilled > before
    print(f"frozen draft: longest gap {gap:.2f} s")
