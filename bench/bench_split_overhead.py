"""What the split costs per round on the CPU: the same requests through the in-process engine and through the
three services over loopback gRPC, at batch 1, 16 and 64; the difference in time per round is the price of
serialization + gRPC + scheduling across processes. Also times serializing and parsing one round's Propose and
Verify messages alone.

    python bench/bench_split_overhead.py [--max-tokens 48]
"""

import argparse
import asyncio
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "e2e"))

from bench_common import print_table, write_results  # noqa: E402
from bench_engine_cpu import build_pair  # noqa: E402
from cluster import Cluster  # noqa: E402
from specsplit.client import Client  # noqa: E402
from specsplit.proto.v1 import worker_pb2  # noqa: E402
from specsplit.services.coordinator.coordinator import CoordinatorConfig  # noqa: E402
from specsplit.services.draft.proposer import Proposal, ProposeItem  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.rpc import worker_messages as msg  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402
from specsplit.services.target.verifier import VerifyItem  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:", "The answer is"]


def serialization_cost(batch: int, k: int = 4, support: int = 32, repeats: int = 20) -> float:
    """Seconds to build, serialize and parse one round's Propose and Verify messages (both directions)."""
    proposals = [Proposal(list(range(k)), torch.randint(0, 150000, (k, support)), torch.rand(k, support), 100) for _ in range(batch)]
    start = time.perf_counter()
    for _ in range(repeats):
        request = worker_pb2.ProposeRequest.FromString(msg.propose_request([ProposeItem(f"h{i}", 100, [5], k) for i in range(batch)]).SerializeToString())
        msg.propose_items(request)
        response = worker_pb2.ProposeResponse.FromString(msg.propose_response(proposals).SerializeToString())
        got = msg.proposals(response)
        items = [VerifyItem(f"h{i}", 100, [5], p.token_ids, p.q_token_ids, p.q_probs) for i, p in enumerate(got)]
        msg.verify_items(worker_pb2.VerifyRequest.FromString(msg.verify_request(items).SerializeToString()))
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    target_dir, draft_dir = build_pair(root)
    batches = [int(b) for b in args.batches.split(",")]
    engine = LocalEngine(str(target_dir), str(draft_dir), num_speculative_tokens=4, num_kv_blocks=1024,
                         coordinator_config=CoordinatorConfig(max_num_seqs=256), prefix_caching=False)
    cluster = Cluster()
    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1"]
    kv = ["--num-kv-blocks", "1024", "--no-prefix-caching"]  # every pass pays its prefills, like the engine
    # The services get the same single torch thread as the in-process engine, so the comparison is like for like.
    env = {"OMP_NUM_THREADS": "1"}
    cluster.start({"target": ["target", "--model", str(target_dir), *common, *kv], "draft": ["draft", "--model", str(draft_dir), *common, *kv]}, env=env)
    cluster.start({"coordinator": ["coordinator", "--target", cluster.addresses["target"], "--draft", cluster.addresses["draft"], *common, "-k", "4"]}, env=env)
    rows = []
    try:
        with Client(cluster.addresses["coordinator"], timeout=600) as client:
            for batch in batches:
                prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(batch)]
                params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
                measured = {}
                for repeat in range(2):  # interleaved so drifting load hits both paths alike
                    async def local_run():
                        results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
                        await engine.coordinator.wait_idle()
                        return results

                    start = time.perf_counter()
                    local_results = asyncio.run(local_run())
                    measured.setdefault("local", []).append((time.perf_counter() - start, max(r.stats.rounds for r in local_results)))
                    start = time.perf_counter()
                    with ThreadPoolExecutor(batch) as pool:
                        split_results = list(pool.map(lambda p: client.generate(p, max_tokens=args.max_tokens, ignore_eos=True), prompts))
                    measured.setdefault("split", []).append((time.perf_counter() - start, max(r.stats.rounds for r in split_results)))
                    assert [r.token_ids for r in split_results] == [r.token_ids for r in local_results]
                per_round = {path: min(t / rounds for t, rounds in runs) for path, runs in measured.items()}
                rows.append({
                    "batch": batch,
                    "round_ms_in_process": 1000 * per_round["local"],
                    "round_ms_split": 1000 * per_round["split"],
                    "split_overhead_share": (per_round["split"] - per_round["local"]) / per_round["split"],
                    "serialization_ms_per_round": 1000 * serialization_cost(batch),
                })
                print(rows[-1], flush=True)
    finally:
        cluster.stop()
    write_results("split_overhead_cpu", rows, {"models": "random Qwen2 12-layer target (hidden 256) and its first 3 layers as draft", "k": 4})
    print_table(rows, ["batch", "round_ms_in_process", "round_ms_split", "split_overhead_share", "serialization_ms_per_round"])


if __name__ == "__main__":
    main()
