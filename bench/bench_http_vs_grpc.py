"""What the OpenAI-compatible HTTP API costs against the gRPC API, on the real pair on the CPU (Qwen2.5-Coder 1.5B
target, 0.5B draft, float32, the services' default weight formats), through the same running services.

The same greedy requests (streamed, `ignore_eos`, a fixed number of tokens) go through the gRPC API (the project's
Python client) and through HTTP (server-sent events) read by the real `openai` client ("http") and by plain httpx +
json ("http-raw": the server's cost without the openai client's parsing), interleaved so drifting load hits
both alike: at batch 1 (one request at a time) and with `--concurrency` streams at once. Reports tokens/s (completion
tokens over wall time) and time to the first streamed token, as the client sees them, and HTTP's cost in percent.
The goal: HTTP costs no more than 5% at batch 1.

    python bench/bench_http_vs_grpc.py [--max-tokens 48] [--repeats 3] [--concurrency 32] [--concurrent-tokens 24]
"""

import argparse
import http.client
import json
import statistics
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "e2e"))

import openai  # noqa: E402

from bench_common import print_table, write_results  # noqa: E402
from cluster import Cluster  # noqa: E402
from specsplit.client import Client  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPTS = [
    "def is_prime(n: int) -> bool:\n",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "def parse_csv_line(line: str) -> list[str]:\n",
]


def over_grpc(client: Client, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """-> (seconds to the first token, total seconds, completion tokens), streamed."""
    start = time.perf_counter()
    first, tokens = None, 0
    for chunk in client.generate_stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        if chunk.token_ids and first is None:
            first = time.perf_counter() - start
        tokens += len(chunk.token_ids)
    return first, time.perf_counter() - start, tokens


def over_http(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    start = time.perf_counter()
    first, tokens = None, 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first, time.perf_counter() - start, tokens


def over_raw_http(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """The same stream read with the standard library (http.client + json): the server's cost without the openai
    client's parsing."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    parts = urllib.parse.urlsplit(url)
    start = time.perf_counter()
    first, tokens = None, 0
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=900)
    connection.request("POST", parts.path + "/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
            first = time.perf_counter() - start
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    connection.close()
    return first, time.perf_counter() - start, tokens


def batch_one(run, prompts, max_tokens) -> dict:
    results = [run(p, max_tokens) for p in prompts]
    seconds = sum(r[1] for r in results)
    tokens = sum(r[2] for r in results)
    return {"tokens": tokens, "seconds": seconds, "ttfts": [r[0] for r in results]}


def concurrent(run, prompts, max_tokens) -> dict:
    with ThreadPoolExecutor(len(prompts)) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda p: run(p, max_tokens), prompts))
        seconds = time.perf_counter() - start
    return {"tokens": sum(r[2] for r in results), "seconds": seconds, "ttfts": [r[0] for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per request at batch 1")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved passes over the prompts at batch 1")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--concurrent-tokens", type=int, default=24, help="tokens per request in the concurrent run")
    parser.add_argument("--out", default="http_vs_grpc_cpu")
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--draft", default=DRAFT)
    args = parser.parse_args()

    cluster = Cluster()
    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1"]
    cluster.start({"target": ["target", "--model", args.target, *common], "draft": ["draft", "--model", args.draft, *common]})
    cluster.start({"coordinator": ["coordinator", "--target", cluster.addresses["target"], "--draft",
                                   cluster.addresses["draft"], *common, "--http-port", "0", "-k", "4"]})
    url = next(line.rsplit(" ", 1)[-1] for line in cluster.processes["coordinator"].startup_lines if " OpenAI API on " in line)
    rows, samples = [], {}
    try:
        with Client(cluster.addresses["coordinator"], timeout=900) as grpc_client:
            http_client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=900)
            model = http_client.models.list().data[0].id
            paths = {"grpc": lambda p, n: over_grpc(grpc_client, p, n),
                     "http": lambda p, n: over_http(http_client, model, p, n),
                     "http-raw": lambda p, n: over_raw_http(url, model, p, n)}
            for run in paths.values():  # warm-up: the first requests pay one-time costs on both paths
                run(PROMPTS[0], 4)
            for name in paths:
                samples[("batch 1", name)] = []
            for repeat in range(args.repeats):
                order = list(paths)[repeat % 3:] + list(paths)[: repeat % 3]  # rotated: no path always goes first
                for prompt in PROMPTS:
                    for name in order:
                        samples[("batch 1", name)].append(batch_one(paths[name], [prompt], args.max_tokens))
            many = [PROMPTS[i % len(PROMPTS)] + f"    # variant {i}\n" for i in range(args.concurrency)]
            for name in paths:
                samples[(f"{args.concurrency} streams", name)] = [concurrent(paths[name], many, args.concurrent_tokens)]
    finally:
        cluster.stop()

    for (setting, path), runs in samples.items():
        tokens = sum(r["tokens"] for r in runs)
        seconds = sum(r["seconds"] for r in runs)
        ttfts = [t for r in runs for t in r["ttfts"]]
        rows.append({"setting": setting, "path": path, "requests": len(ttfts), "tokens": tokens,
                     "tokens_per_s": tokens / seconds, "ttft_mean_s": statistics.mean(ttfts),
                     "ttft_median_s": statistics.median(ttfts)})
    for row in rows:
        if row["path"] != "grpc":
            base = next(r for r in rows if r["setting"] == row["setting"] and r["path"] == "grpc")
            row["throughput_cost_pct"] = 100 * (1 - row["tokens_per_s"] / base["tokens_per_s"])
            row["ttft_cost_pct"] = 100 * (row["ttft_mean_s"] / base["ttft_mean_s"] - 1)
    batch1 = next(r for r in rows if r["setting"] == "batch 1" and r["path"] == "http")
    goal_met = batch1["throughput_cost_pct"] <= 5.0 and batch1["ttft_cost_pct"] <= 5.0
    print_table(rows, ["setting", "path", "requests", "tokens", "tokens_per_s", "ttft_mean_s", "ttft_median_s",
                       "throughput_cost_pct", "ttft_cost_pct"])
    print(f"goal (HTTP costs <= 5% at batch 1, tokens/s and time to first token): {'met' if goal_met else 'NOT met'}")
    path = write_results(args.out, rows, {"target": args.target, "draft": args.draft, "max_tokens": args.max_tokens,
                                           "concurrent_tokens": args.concurrent_tokens, "goal_met": goal_met})
    print(f"results in {path}")


if __name__ == "__main__":
    main()
