"""Prefix caching: requests that share a long leading prompt (a system prompt, few-shot examples), with the workers'
prefix caches on and off, in one run.

Random-weight Qwen2.5 shapes in bf16 (as bench_gpu_e2e.py), k = 4 with **synthetic acceptance** 0.7 (benchmark
only, not lossless; services/target/synthetic_acceptance.py). Every request is the same `--prefix-len` random tokens
followed by its own `--suffix-len`, `--max-tokens` new tokens. One request at a time (time to first token is the
prefill) and `--batch` at once; the first request of each pass finds nothing cached and is left out of the medians.

Before timing, a float32 check on a 1.5B shape: the last prompt row's logits from a prefill of the suffix alone on
cached prefix blocks against a prefill of the whole prompt, and target-only greedy outputs with the cache on and off.

    python bench/bench_prefix_cache.py [--target 7b --draft 0.5b --prefix-len 2048 --suffix-len 64 --requests 16]
"""

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import bench_gpu_e2e as gpu  # noqa: E402
from bench_common import print_table, write_results  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402


def prompts(args) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, gpu.VOCAB, (args.prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(0, gpu.VOCAB, (args.suffix_len,), generator=g).tolist()
            for _ in range(args.requests + 1)]


async def one_by_one(engine, requests, params):
    out = []
    for ids in requests:
        start = time.perf_counter()
        result = await engine.generate(ids, params)
        out.append((result, time.perf_counter() - start))
    return out


async def batched(engine, requests, params, batch):
    start = time.perf_counter()
    results = []
    for i in range(0, len(requests), batch):
        results += await asyncio.gather(*(engine.generate(ids, params) for ids in requests[i : i + batch]))
    return results, time.perf_counter() - start


def float32_check(prefix_len: int = 512, suffix_len: int = 64, requests: int = 6) -> dict:
    from specsplit.services.kv.block_manager import BlockTable
    from specsplit.services.runtime.model_runner import ForwardItem, ModelRunner

    loaded = gpu.loaded_from_hf(gpu.hf_random_model("1.5b", 0), "1.5b")
    loaded.model.to(torch.float32)
    runner = ModelRunner(loaded, num_blocks=256)
    manager = runner.block_manager
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, gpu.VOCAB, (prefix_len,), generator=g).tolist()
    suffixes = torch.randint(0, gpu.VOCAB, (requests, suffix_len), generator=g).tolist()
    prompt = prefix + suffixes[0]

    def last_logits(reuse: bool) -> torch.Tensor:
        table = BlockTable()
        cached = manager.reuse_prefix(table, prompt, len(prompt) - 1) if reuse else 0
        item = ForwardItem(table, prompt[cached:], 1)
        runner.reserve([item])
        logits = runner.forward([item])[0]
        manager.remember_prefix(table, prompt)
        manager.free(table)
        return logits

    whole = last_logits(reuse=False)
    from_cache = last_logits(reuse=True)
    outputs = {}
    for caching in (False, True):
        engine = LocalEngine(loaded, None, num_speculative_tokens=0, prefix_caching=caching)
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        outputs[caching] = [r.token_ids for r, _ in asyncio.run(one_by_one(engine, [prefix + s for s in suffixes], params))]
    del runner, loaded
    gpu._empty_cache()
    return {"shape": "1.5b", "dtype": "float32", "prefix_tokens_from_cache": manager.prefix_cache.hit_tokens,
            "max_abs_logit_difference": (whole - from_cache).abs().max().item(), "logit_std": whole.std().item(),
            "same_argmax": bool(whole.argmax() == from_cache.argmax()),
            "greedy_outputs_equal_on_off": f"{sum(a == b for a, b in zip(outputs[True], outputs[False]))}/{requests}"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="7b", choices=list(gpu.QWEN25))
    parser.add_argument("--draft", default="0.5b", choices=list(gpu.QWEN25))
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=0.7)
    args = parser.parse_args()

    check = float32_check()
    gpu.log("float32 check:", check)
    target = gpu.loaded_from_hf(gpu.hf_random_model(args.target, 0), args.target)
    draft = gpu.loaded_from_hf(gpu.hf_random_model(args.draft, 1), args.draft)
    requests = prompts(args)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, num_speculative_tokens=4, speculation="fixed")
    rows, outputs = [], {}
    for caching in (False, True):
        engine = LocalEngine(target, draft, num_speculative_tokens=4, prefix_caching=caching,
                             synthetic_acceptance=args.alpha)
        asyncio.run(one_by_one(engine, [requests[0][:64]], params))  # warm-up: first calls pay one-time costs
        serial = asyncio.run(one_by_one(engine, requests, params))[1:]  # the first one fills the cache
        ttft = [r.time_to_first_token for r, _ in serial]
        total = [elapsed for _, elapsed in serial]
        together, wall = asyncio.run(batched(engine, requests[1:], params, args.batch))
        outputs[caching] = [r.token_ids for r, _ in serial]
        hit = engine.target_runner.block_manager.prefix_cache.hit_tokens if caching else 0
        queried = engine.target_runner.block_manager.prefix_cache.queried_tokens if caching else 0
        rows.append({
            "prefix_caching": caching,
            "ttft_median_ms": 1000 * statistics.median(ttft),
            "request_median_ms": 1000 * statistics.median(total),
            f"batch{args.batch}_requests_per_s": len(together) / wall,
            "target_prompt_tokens_from_cache": hit / queried if queried else 0.0,
        })
        gpu.log(rows[-1])
        del engine
        gpu._empty_cache()
    off, on = rows
    on["ttft_vs_off"] = off["ttft_median_ms"] / on["ttft_median_ms"]
    on["requests_per_s_vs_off"] = on[f"batch{args.batch}_requests_per_s"] / off[f"batch{args.batch}_requests_per_s"]
    same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
    extra = {"args": vars(args), "device": gpu.DEVICE, "synthetic_acceptance": args.alpha, "float32_check": check,
             "greedy_outputs_equal_on_off": f"{same}/{len(outputs[True])} (bf16: a prefill of the suffix alone rounds "
                                            "differently from the whole prompt's, so near-ties may part)"}
    write_results("prefix_cache_" + ("gpu" if gpu.DEVICE != "cpu" else "cpu"), rows, extra)
    print_table(rows, list(rows[1]))


if __name__ == "__main__":
    main()
