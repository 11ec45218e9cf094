"""Load test on the CPU with tiny models, a scenario on the `specsplit bench` harness: requests (greedy and sampled,
8-96 tokens, prompts up to 200 characters, 5% deliberately invalid) from `--concurrency` clients at once through a
real `specsplit serve` (specsplit/bench/serve_process.py), sent and timed by the harness's driver and gRPC client.
Beside the harness's numbers: the status of every request (the invalid ones must be INVALID_ARGUMENT, nothing
else), each process's memory over the run, and the KV blocks left held at the end (must be zero). It exits non-zero
when any of these does not hold, or when the server went away before the last request.

    python bench/load_test.py --concurrency 16 --num-prompts 900
"""

import argparse
import asyncio
import math
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "e2e"))

from bench_common import print_table, write_results  # noqa: E402
from cluster import scrape  # noqa: E402
from peak_memory import process_status, process_tree  # noqa: E402
from specsplit.bench.grpc_client import GrpcClient  # noqa: E402
from specsplit.bench.load_generator import run_load  # noqa: E402
from specsplit.bench.serve_process import ServeProcess  # noqa: E402
from specsplit.bench.summary import summarize  # noqa: E402
from specsplit.bench.workloads import BenchRequest  # noqa: E402
from tiny_models import build_model, perturbed_copy, save_model  # noqa: E402


def mixed_requests(count: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt = rng.choice(["def f(x):", "hello world", "import os\n", "x" * rng.randint(1, 200)])
        temperature = -1.0 if rng.random() < 0.05 else rng.choice([0.0, 0.7, 1.0])  # -1: must be INVALID_ARGUMENT
        requests.append(BenchRequest(prompt, rng.randint(8, 96), temperature=temperature, seed=rng.randint(0, 2**32)))
    return requests


def process_tree_rss_mb(root_pid: int) -> dict[str, float]:
    """RSS in MiB of each process under `root_pid`, by its role (target, draft, coordinator)."""
    out = {}
    for pid in process_tree(root_pid)[1:]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue  # gone since the tree was read
        role = argv[argv.index("specsplit") + 1] if "specsplit" in argv[:-1] else argv[0]
        rss = process_status(pid).get("VmRSS")
        if rss is not None:
            out[role] = round(rss / 2**20, 1)
    return out


def kv_blocks_used(url: str, role: str) -> float | None:
    """KV blocks a worker holds once its requests are done (None: it cannot be asked, gone with the server)."""
    deadline = time.monotonic() + 15
    while True:
        try:
            used = scrape(url)[("specsplit_kv_blocks_used", (("role", role),))]
        except OSError:
            return None
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def problems(run, codes: dict[str, int], sent: int, invalid: int, kv_held: dict) -> list[str]:
    """What the load test requires and this run did not do (empty: it passed)."""
    found = []
    if run.interrupted:
        found.append(f"the server went away after {len(run.records)} of {sent} answers: {run.interrupted}")
    elif Counter(codes) != Counter({"OK": sent - invalid, "INVALID_ARGUMENT": invalid}):
        found.append(f"statuses {codes}; expected {invalid} INVALID_ARGUMENT and the rest OK")
    if any(used != 0 for used in kv_held.values()):
        found.append(f"KV blocks held at the end (None: not reachable): {kv_held}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=900)
    args = parser.parse_args()
    requests = mixed_requests(args.num_prompts)
    invalid = sum(request.temperature < 0 for request in requests)
    root = Path(tempfile.mkdtemp())
    target = build_model("qwen2", seed=0)
    save_model(target, root / "target")
    save_model(perturbed_copy(target, 0.01), root / "draft")
    memory, done = [], threading.Event()
    with ServeProcess(["--target", str(root / "target"), "--draft", str(root / "draft"), "--num-kv-blocks", "256"],
                      http=False) as served:
        began = time.perf_counter()

        def sample_memory():
            while not done.wait(5 if memory else 0):
                memory.append({**process_tree_rss_mb(served.process.pid), "t": round(time.perf_counter() - began, 1)})

        sampler = threading.Thread(target=sample_memory)
        sampler.start()

        async def run():
            client = await GrpcClient(served.address, timeout=60).start()
            try:
                return await run_load(client, requests, math.inf, args.concurrency)
            finally:
                await client.close()

        run = asyncio.run(run())
        done.set()
        sampler.join()
        memory.append({**process_tree_rss_mb(served.process.pid), "t": round(time.perf_counter() - began, 1)})
        kv_held = {role: kv_blocks_used(served.metrics_url(role), role) for role in ("target", "draft")}
    summary = summarize(run)
    codes = dict(Counter("OK" if r.ok else r.error.split(":", 1)[0] for r in run.records))  # every record, each once
    row = {"concurrency": args.concurrency, "duration_s": round(run.duration, 1), "requests": len(run.records),
           "interrupted": run.interrupted, "codes": codes, "tokens_per_s": summary["output_tokens_per_s"],
           "latency_p50_s": summary["e2el_ms"]["p50"] / 1e3, "latency_p99_s": summary["e2el_ms"]["p99"] / 1e3,
           "ttft_p50_s": summary["ttft_ms"]["p50"] / 1e3, "ttft_p99_s": summary["ttft_ms"]["p99"] / 1e3,
           "kv_blocks_held_at_end": kv_held, "rss_mb_first": memory[0], "rss_mb_last": memory[-1]}
    path = write_results("load_cpu", [row], {"summary": summary, "memory_samples": memory})
    print_table([row], ["concurrency", "duration_s", "requests", "tokens_per_s", "latency_p50_s", "latency_p99_s",
                        "ttft_p50_s", "ttft_p99_s"])
    print("codes", codes, "kv held at end", kv_held, "rss first/last", row["rss_mb_first"], row["rss_mb_last"])
    print(f"results in {path}")
    failures = problems(run, codes, len(requests), invalid, kv_held)
    for failure in failures:
        print("FAILED:", failure, file=sys.stderr)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
