"""What only two GPUs can show, on tiny float32 models; skipped with fewer than two CUDA GPUs (CI has none, the lent
2-GPU machine runs it):
- tensor parallelism over NCCL: a target at degree 2 (ranks on cuda:0 and cuda:1) gives the degree-1 target's greedy
  tokens and seeded samples, target-only and speculative (draft at degree 1); and so should the peer-to-peer
  all-reduces over NVLink (torch's one-shot over symmetric memory, our fused all-reduce + RMSNorm kernel);
- overlapped rounds across the split over real processes: target on cuda:0, draft on cuda:1, a coordinator with
  --overlap on and one with --overlap off give the target alone's greedy tokens and the same seeded samples.
"""

import asyncio
import time

import pytest
import torch

from specsplit.services.local_engine import LocalEngine
from specsplit.services.runtime.tensor_parallel_all_reduce import MODE_ENV, peer_setups_in_this_process
from cluster import Cluster, generate_concurrently
from engine_runs import generate_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

PROMPTS = ["def add(a, b):", "x", "The quick brown fox jumps over the lazy dog. " * 3, "1, 2, 3, 5, 8, 13,"]
MAX_TOKENS = 48


def generate(engine: LocalEngine, k: int, temperature: float = 0.0) -> list[list[int]]:
    seeds = [100 + i for i in range(len(PROMPTS))] if temperature else None
    return generate_tokens(engine, PROMPTS, k, MAX_TOKENS, temperature, seeds)


def outputs(engine: LocalEngine) -> dict:
    try:
        return {"greedy": generate(engine, 0), "spec_greedy": generate(engine, 4),
                "sampled": generate(engine, 0, 0.8), "spec_sampled": generate(engine, 4, 0.8)}
    finally:
        asyncio.run(engine.close())


def sharded_engine(tiny_pair) -> LocalEngine:
    """The target at degree 2 (cuda:0 and cuda:1), the draft at degree 1, k = 4 fixed, float32."""
    return LocalEngine(str(tiny_pair["target"]), str(tiny_pair["close"]), num_speculative_tokens=4, dtype="float32",
                       device="cuda", speculation="fixed", target_tensor_parallel_size=2)


@pytest.fixture(scope="module")
def degree_one(tiny_pair):
    return outputs(LocalEngine(str(tiny_pair["target"]), str(tiny_pair["close"]), num_speculative_tokens=4,
                               dtype="float32", device="cuda", speculation="fixed"))


def test_nccl_degree_two_gives_the_degree_one_tokens(tiny_pair, degree_one, monkeypatch):
    # NCCL by name: the default ("auto") would set up peer buffers here, and a process sets them up once for the
    # replica whose rank 0 it holds first (runtime/tensor_parallel_all_reduce.py): the next test's.
    monkeypatch.setenv(MODE_ENV, "nccl")
    sharded = outputs(sharded_engine(tiny_pair))
    assert degree_one["spec_greedy"] == degree_one["greedy"]  # speculation is lossless on the GPU to begin with
    assert sharded["greedy"] == degree_one["greedy"]
    assert sharded["spec_greedy"] == degree_one["greedy"]
    assert sharded["sampled"] == degree_one["sampled"]
    assert sharded["spec_sampled"] == degree_one["spec_sampled"]


def test_peer_to_peer_all_reduces_give_the_degree_one_tokens(tiny_pair, degree_one):
    engine = sharded_engine(tiny_pair)
    try:
        assert engine.target_runner.group.all_reduce.mode == "fused"  # the default, where it runs
        for mode in ("symm", "fused"):
            assert engine.target_runner.use_all_reduce(mode) == mode  # both GPUs reach each other over NVLink
            assert generate(engine, 0) == degree_one["greedy"], mode
            assert generate(engine, 4) == degree_one["greedy"], mode
            assert generate(engine, 4, 0.8) == degree_one["spec_sampled"], mode
    finally:
        asyncio.run(engine.close())


def test_a_second_replica_led_from_the_same_process_uses_nccl_without_waiting(tiny_pair, degree_one):
    """torch's rendezvous numbers its keys per process: this process set up peer buffers for the previous test's
    replica, its new followers never did, so the ranks must agree on NCCL at once instead of waiting on the store."""
    if peer_setups_in_this_process() == 0:  # run without the test before it: lead one replica's setup first
        asyncio.run(sharded_engine(tiny_pair).close())
    assert peer_setups_in_this_process() >= 1
    started = time.monotonic()
    engine = sharded_engine(tiny_pair)
    try:
        assert engine.target_runner.group.all_reduce.mode == "nccl"
        # Starting the engine takes ~60 s on the lent 2x H200 (loads, graph captures): waiting for the other
        # rank's rendezvous keys would add the store's 120 s timeout, then NCCL's watchdog would end the ranks.
        assert time.monotonic() - started < 115
        assert generate(engine, 4) == degree_one["greedy"]
    finally:
        asyncio.run(engine.close())


@pytest.fixture(scope="module")
def split_over_two_gpus(tiny_pair):
    c = Cluster()
    model = ["--dtype", "float32", "--metrics-port", "-1", "--host", "127.0.0.1", "--port", "0"]
    try:
        c.start({"target": ["target", "--model", str(tiny_pair["target"]), "--device", "cuda:0", *model],
                 "draft": ["draft", "--model", str(tiny_pair["close"]), "--device", "cuda:1", *model,
                           "--warm-up-k", "5"]})
        a = c.addresses
        common = ["coordinator", "--target", a["target"], "--draft", a["draft"], "--host", "127.0.0.1", "--port", "0",
                  "-k", "4", "--speculation", "fixed", "--metrics-port", "-1"]
        c.start({"on": [*common, "--overlap", "on"], "off": [*common, "--overlap", "off"]})
        yield c
    finally:
        c.stop()


def generate_all(address: str, **params) -> list:
    return generate_concurrently(address, PROMPTS, MAX_TOKENS, timeout=300, **params)


def test_overlapped_split_across_gpus_is_lossless(split_over_two_gpus, degree_one):
    on = generate_all(split_over_two_gpus.addresses["on"])
    off = generate_all(split_over_two_gpus.addresses["off"])
    assert [list(r.token_ids) for r in off] == degree_one["greedy"]
    assert [list(r.token_ids) for r in on] == degree_one["greedy"]
    assert sum(r.stats.pre_proposed_rounds for r in on) > 0  # the draft really proposed during verifications
    on = generate_all(split_over_two_gpus.addresses["on"], temperature=0.8, seed=7)
    off = generate_all(split_over_two_gpus.addresses["off"], temperature=0.8, seed=7)
    assert [list(r.token_ids) for r in on] == [list(r.token_ids) for r in off]
