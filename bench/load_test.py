"""Load test on the CPU with tiny models: N concurrent clients stream requests through real processes for a
bounded time, then stop. Records throughput, latency percentiles, status codes, each process's memory over time
and the KV blocks left held at the end (must be zero).

    python bench/load_test.py --concurrency 16 --duration 180
"""

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "e2e"))

from bench_common import print_table, write_results  # noqa: E402
from cluster import Cluster  # noqa: E402
from specsplit.proto.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from tiny_models import build_model, perturbed_copy, save_model  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def random_request(rng: random.Random) -> generation_pb2.GenerateRequest:
    m = generation_pb2.GenerateRequest(text=rng.choice(["def f(x):", "hello world", "import os\n", "x" * rng.randint(1, 200)]))
    m.sampling.temperature = rng.choice([0.0, 0.7, 1.0])
    m.sampling.seed = rng.randint(0, 2**32)
    m.stopping.max_tokens = rng.randint(8, 96)
    m.stopping.ignore_eos = True
    if rng.random() < 0.05:
        m.sampling.temperature = -1.0  # a bad request now and then: must be INVALID_ARGUMENT, nothing else
    return m


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=180.0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    target = build_model("qwen2", seed=0)
    save_model(target, root / "target")
    save_model(perturbed_copy(target, 0.01), root / "draft")
    cluster = Cluster()
    cluster.start({
        "target": ["target", "--model", str(root / "target"), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--num-kv-blocks", "256"],
        "draft": ["draft", "--model", str(root / "draft"), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--num-kv-blocks", "256"],
    })
    cluster.start({"coordinator": ["coordinator", "--target", cluster.addresses["target"], "--draft", cluster.addresses["draft"],
                                   "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--max-waiting", "64"]})
    stop_at = time.monotonic() + args.duration
    lock = threading.Lock()
    latencies, ttfts, codes, tokens = [], [], {}, [0]
    memory = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        channel = grpc.insecure_channel(cluster.addresses["coordinator"])
        stub = generation_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            first = None
            n = 0
            try:
                for chunk in stub.GenerateStream(random_request(rng), timeout=60):
                    if first is None and chunk.token_ids:
                        first = time.perf_counter() - start
                    n += len(chunk.token_ids)
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
            with lock:
                codes[code] = codes.get(code, 0) + 1
                if code == "OK":
                    latencies.append(time.perf_counter() - start)
                    ttfts.append(first or 0.0)
                    tokens[0] += n
        channel.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.concurrency)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        memory.append({name: round(rss_mb(p.pid), 1) for name, p in cluster.processes.items()} | {"t": round(time.perf_counter() - began, 1)})
        time.sleep(5)
    elapsed = time.perf_counter() - began
    infos = cluster.wait_kv_free(["target", "draft"])
    cluster.stop()

    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    row = {
        "concurrency": args.concurrency, "duration_s": round(elapsed, 1), "requests": sum(codes.values()),
        "codes": codes, "tokens_per_s": tokens[0] / elapsed,
        "latency_p50_s": pct(latencies, 0.5), "latency_p95_s": pct(latencies, 0.95), "latency_p99_s": pct(latencies, 0.99),
        "ttft_p50_s": pct(ttfts, 0.5), "ttft_p95_s": pct(ttfts, 0.95),
        "kv_blocks_held_at_end": {n: i.kv_blocks_used for n, i in infos.items()},
        "rss_mb_first": memory[1] if len(memory) > 1 else memory[0], "rss_mb_last": memory[-1],
    }
    write_results("load_cpu", [row], {"memory_samples": memory, "torch_threads": torch.get_num_threads()})
    print_table([row], ["concurrency", "duration_s", "requests", "tokens_per_s", "latency_p50_s", "latency_p95_s", "ttft_p50_s", "ttft_p95_s"])
    print("codes", codes, "kv held at end", row["kv_blocks_held_at_end"], "rss first/last", row["rss_mb_first"], row["rss_mb_last"])


if __name__ == "__main__":
    main()
