"""Tensor parallelism with real processes (CPU, gloo): a target worker at --tensor-parallel-size 2 (rank 0 serving
gRPC, rank 1 its child) behind a coordinator with a draft at degree 1 gives the degree-1 output, greedy and seeded
sampling; `serve` runs the same layout; killing rank 1 mid-stream takes that replica down (rank 0 exits) and the
coordinator finishes every request on the other target replica with the fault-free output."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from specsplit.client import Client
from specsplit.services.local_engine import LocalEngine
from specsplit.services.rpc.worker_process import REPLICA_DOWN_EXIT_CODE
from specsplit.services.sampling_params import SamplingParams
from cluster import Cluster

PROMPTS = ["def add(a, b):", "hello world", "import os\n", "class A:"]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """Degree 1, in-process: greedy outputs (target alone) and one seeded sampled output per prompt, speculating
    with the same draft and k as the services (a seed fixes the tokens for a given draft and k)."""
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64",
                         speculation="fixed")

    async def main():
        greedy = [await engine.generate(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                          num_speculative_tokens=0)) for p in PROMPTS]
        sampled = [await engine.generate(p, SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=7))
                   for p in PROMPTS]
        return [r.token_ids for r in greedy], [r.token_ids for r in sampled]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def sharded(tiny_pair):
    c = Cluster()
    model = ["--dtype", "float64", "--metrics-port", "-1", "--num-kv-blocks", "512", "--host", "127.0.0.1", "--port", "0"]
    try:
        c.start({
            "target_tp": ["target", "--model", str(tiny_pair["target"]), "--tensor-parallel-size", "2", *model],
            "target_b": ["target", "--model", str(tiny_pair["target"]), *model],
            "draft": ["draft", "--model", str(tiny_pair["close"]), *model],
        })
        a = c.addresses
        coordinator = ["--host", "127.0.0.1", "--port", "0", "-k", "4", "--speculation", "fixed", "--metrics-port", "-1"]
        c.start({
            "coordinator": ["coordinator", "--target", f"{a['target_tp']},{a['target_b']}", "--draft", a["draft"],
                            "--replica-recovery-seconds", "30", *coordinator],
        })
        yield c
    finally:
        c.stop()


def test_serve_with_a_sharded_target(tiny_pair, reference):
    greedy, _ = reference
    out = subprocess.run([sys.executable, "-m", "specsplit", "serve", "--target", str(tiny_pair["target"]),
                          "--draft", str(tiny_pair["close"]), "--dtype", "float64", "--port", "0", "--metrics-port", "-1",
                          "--target-tensor-parallel-size", "2", "--prompt", PROMPTS[0], "--max-tokens", "40",
                          "--ignore-eos", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["token_ids"] == greedy[0][:40]


def rank_pids(process) -> list[int]:
    return [int(line.rsplit(" ", 1)[-1]) for line in process.startup_lines if " tensor-parallel rank " in line]


def test_sharded_target_worker_gives_degree_one_output(sharded, reference):
    """The coordinator spreads sequences over the sharded replica and the degree-1 one: every output equals the
    degree-1 reference, and the sharded replica served its share."""
    greedy, sampled = reference
    before = sharded.worker_info("target_tp").sequences_prefilled
    with Client(sharded.addresses["coordinator"], timeout=120) as client:
        assert [client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for p in PROMPTS] == greedy
        assert [client.generate(p, max_tokens=24, ignore_eos=True, temperature=0.9, seed=7).token_ids
                for p in PROMPTS] == sampled
    assert sharded.worker_info("target_tp").sequences_prefilled - before >= len(PROMPTS) // 2
    if "tensor_parallel_size" in type(sharded.worker_info("target_tp")).DESCRIPTOR.fields_by_name:  # proto field 14
        assert sharded.worker_info("target_tp").tensor_parallel_size == 2
        assert sharded.worker_info("target_b").tensor_parallel_size == 1
    assert len(rank_pids(sharded.processes["target_tp"])) == 1
    infos = sharded.wait_kv_free(["target_tp", "target_b", "draft"])
    assert all(i.kv_blocks_used == 0 for i in infos.values())


def test_killing_rank_one_fails_over_to_the_other_replica(sharded, reference):
    greedy, _ = reference
    target = sharded.processes["target_tp"]
    (follower,) = rank_pids(target)
    results = [None] * len(PROMPTS)
    started = threading.Barrier(len(PROMPTS) + 1)

    def stream(i):
        tokens = []
        with Client(sharded.addresses["coordinator"], timeout=180) as client:
            for n, chunk in enumerate(client.generate_stream(PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True)):
                tokens.extend(chunk.token_ids)
                if n == 0:
                    started.wait()
        results[i] = tokens

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    started.wait(timeout=120)
    assert sharded.worker_info("target_tp").sequences > 0  # some of the streams run on the sharded replica
    os.kill(follower, signal.SIGKILL)
    for t in threads:
        t.join(timeout=180)
    assert results == greedy  # every request finished, with the fault-free output
    assert target.wait(timeout=30) == REPLICA_DOWN_EXIT_CODE  # rank 0 took its replica down
    infos = sharded.wait_kv_free(["target_b", "draft"])
    assert all(i.kv_blocks_used == 0 for i in infos.values())
