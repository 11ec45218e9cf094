"""Overlapped rounds over real processes: a coordinator with --overlap on and one with --overlap off, over the same
target and drafts, give token-identical greedy output (identical to the target alone) and identical seeded sampled
output; the overlapped one really proposed ahead; a draft or a target killed mid-pipeline loses no request and
leaves no KV on the workers that remain."""

import signal
import threading

import pytest

from specsplit.client import Client
from cluster import Cluster, generate_concurrently

PROMPTS = ["def add(a, b):", "hello world", "import os\n", "class A:"]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def pipeline(tiny_pair):
    c = Cluster()
    model = ["--dtype", "float64", "--metrics-port", "-1", "--num-kv-blocks", "256", "--lease-seconds", "4"]
    try:
        c.start({
            "target": ["target", "--model", str(tiny_pair["target"]), "--host", "127.0.0.1", "--port", "0", *model],
            "target_b": ["target", "--model", str(tiny_pair["target"]), "--host", "127.0.0.1", "--port", "0", *model],
            "draft_a": ["draft", "--model", str(tiny_pair["close"]), "--host", "127.0.0.1", "--port", "0", *model],
            "draft_b": ["draft", "--model", str(tiny_pair["close"]), "--host", "127.0.0.1", "--port", "0", *model],
        })
        a = c.addresses
        common = ["--target", f"{a['target']},{a['target_b']}", "--host", "127.0.0.1", "--port", "0", "-k", "4", "--speculation", "fixed",
                  "--metrics-port", "-1"]
        c.start({
            "on": ["coordinator", *common, "--draft", f"{a['draft_a']},{a['draft_b']}", "--overlap", "on"],
            "off": ["coordinator", *common, "--draft", a["draft_a"], "--overlap", "off"],
        })
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def greedy_alone(target_alone):
    return [target_alone(p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for p in PROMPTS]


def generate_all(address: str, **params) -> list:
    return generate_concurrently(address, PROMPTS, MAX_TOKENS, **params)


def test_greedy_identical_with_and_without_overlap(pipeline, greedy_alone):
    on = generate_all(pipeline.addresses["on"])
    off = generate_all(pipeline.addresses["off"])
    assert [list(r.token_ids) for r in off] == greedy_alone
    assert [list(r.token_ids) for r in on] == greedy_alone
    # The pipelined coordinator verified rounds whose proposals the draft made during the previous verification.
    assert sum(r.stats.pre_proposed_rounds for r in on) > 0
    assert sum(r.stats.pre_proposed_rounds for r in off) == 0


def test_seeded_sampling_identical_with_and_without_overlap(pipeline):
    on = generate_all(pipeline.addresses["on"], temperature=0.4, seed=7)
    off = generate_all(pipeline.addresses["off"], temperature=0.4, seed=7)
    assert [list(r.token_ids) for r in on] == [list(r.token_ids) for r in off]


def kill_mid_stream(pipeline, victim: str) -> list:
    """Stream every prompt through the overlapped coordinator and SIGKILL `victim` once all are under way."""
    address = pipeline.addresses["on"]
    started = threading.Barrier(len(PROMPTS) + 1)
    results = [None] * len(PROMPTS)

    def run(i):
        tokens = []
        with Client(address, timeout=120) as client:
            for n, chunk in enumerate(client.generate_stream(PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True)):
                tokens.extend(chunk.token_ids)
                if n == 1:
                    started.wait()
        results[i] = tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    started.wait(timeout=120)
    pipeline.processes[victim].send_signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=180)
    return results


def test_draft_killed_mid_pipeline_loses_nothing_and_leaks_no_kv(pipeline, greedy_alone):
    results = kill_mid_stream(pipeline, "draft_a")
    assert results == greedy_alone  # every request completed, with exactly the fault-free greedy output
    infos = pipeline.wait_kv_free(["target", "target_b", "draft_b"])
    assert all(i.kv_blocks_used == 0 and i.sequences == 0 for i in infos.values())


def test_target_killed_mid_pipeline_loses_nothing_and_leaks_no_kv(pipeline, greedy_alone):
    results = kill_mid_stream(pipeline, "target")  # its sequences are re-prefilled on target_b
    assert results == greedy_alone
    infos = pipeline.wait_kv_free(["target_b", "draft_b"])
    assert all(i.kv_blocks_used == 0 and i.sequences == 0 for i in infos.values())
