"""The real pair on the CPU: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct (float32).

Part A, acceptance: HumanEval prompts (code) and Shakespeare passages (prose), k in {2, 4, 6}, greedy and
temperature 0.7, through the in-process engine (acceptance does not depend on the transport). Records acceptance
rate, mean emitted tokens per round and per-position acceptance, and checks greedy speculative output equals this
engine's target-only output on every prompt.

Part B, speed at batch 1 on the same prompts, one system after another in this one run: transformers `generate`
(target alone), transformers assisted generation (`assistant_model=` the draft), the split services over gRPC
(three processes, target-only and k=4), and the in-process engine (k=4). Greedy output of the split services is
compared token for token with transformers' greedy generate on every prompt measured.

    python bench/bench_real_pair_cpu.py [--acceptance-prompts 164] [--prose-prompts 40] [--speed-prompts 10]
"""

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from prompts import humaneval_prompts, shakespeare_prompts  # noqa: E402
from specsplit.services.coordinator.coordinator import CoordinatorConfig  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.models.prepare import resolve_model  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


async def run_all(engine, prompts, params, concurrency):
    semaphore = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with semaphore:
            return await engine.coordinator.generate(engine.request(prompt, params))

    results = await asyncio.gather(*(one(p) for p in prompts))
    await engine.coordinator.wait_idle()
    return results


def acceptance_part(args, target_dir, draft_dir) -> tuple[list[dict], dict]:
    engine = LocalEngine(str(target_dir), str(draft_dir), num_speculative_tokens=6, num_kv_blocks=args.kv_blocks,
                         coordinator_config=CoordinatorConfig(max_num_seqs=args.concurrency))
    sets = {
        "humaneval": [p["prompt"] for p in humaneval_prompts(args.acceptance_prompts)],
        "shakespeare": [p["prompt"] for p in shakespeare_prompts(args.prose_prompts, 400, seed=0)],
    }
    rows, mismatches = [], {}
    for name, prompts in sets.items():
        base = asyncio.run(run_all(engine, prompts, SamplingParams(max_tokens=args.max_tokens, num_speculative_tokens=0), args.concurrency))
        for temperature in (0.0, 0.7):
            for k in (2, 4, 6):
                params = SamplingParams(max_tokens=args.max_tokens, num_speculative_tokens=k, temperature=temperature, seed=7)
                start = time.perf_counter()
                results = asyncio.run(run_all(engine, prompts, params, args.concurrency))
                elapsed = time.perf_counter() - start
                drafted = sum(r.stats.draft_tokens for r in results)
                accepted = sum(r.stats.accepted_tokens for r in results)
                rounds = sum(r.stats.rounds for r in results)
                emitted = sum(len(r.token_ids) - 1 for r in results)  # the first token comes from prefill
                per_pos_d = [sum(r.stats.drafted_per_position[i] for r in results if len(r.stats.drafted_per_position) > i) for i in range(k)]
                per_pos_a = [sum(r.stats.accepted_per_position[i] for r in results if len(r.stats.accepted_per_position) > i) for i in range(k)]
                row = {
                    "prompts": name, "n": len(prompts), "temperature": temperature, "k": k,
                    "acceptance": accepted / drafted if drafted else 0.0,
                    "tokens_per_round": emitted / rounds if rounds else 0.0,
                    "per_position": [round(a / d, 3) if d else None for a, d in zip(per_pos_a, per_pos_d)],
                    "wall_s": elapsed,
                }
                if temperature == 0.0:
                    bad = [i for i, (r, b) in enumerate(zip(results, base)) if r.token_ids != b.token_ids]
                    row["identical_to_target_only"] = not bad
                    mismatches[f"{name}-k{k}"] = bad
                rows.append(row)
                print({k2: v for k2, v in row.items() if k2 != "per_position"}, flush=True)
    del engine
    gc.collect()
    return rows, mismatches


def speed_part(args, target_dir, draft_dir) -> tuple[list[dict], dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specsplit.client import Client
    from specsplit.services.service_commands import spawn_service

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [p["prompt"] for p in humaneval_prompts(args.speed_prompts)]
    ids = [tokenizer.encode(p) for p in prompts]
    n = args.speed_max_tokens
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[list[int]]] = {}

    def record(system, elapsed, out):
        times.setdefault(system, []).append(elapsed)
        tokens.setdefault(system, []).append(out)

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    for prompt_ids in ids:
        x = torch.tensor([prompt_ids])
        with torch.no_grad():
            for system, extra in (("transformers", {}), ("transformers_assisted", {"assistant_model": draft})):
                start = time.perf_counter()
                out = target.generate(x, max_new_tokens=n, do_sample=False, **extra)
                record(system, time.perf_counter() - start, out[0, len(prompt_ids):].tolist())
        print("transformers done for a prompt", flush=True)
    del target, draft
    gc.collect()

    serve, address = spawn_service(["serve", "--target", str(target_dir), "--draft", str(draft_dir), "--port", "0", "--metrics-port", "0",
                                    "-k", "4", "--num-kv-blocks", str(args.kv_blocks)])
    try:
        with Client(address, timeout=3600) as client:
            client.generate(ids[0], max_tokens=4)  # warm-up
            for prompt_ids in ids:
                for system, k in (("split_target_only", 0), ("split_speculative_k4", 4)):
                    start = time.perf_counter()
                    r = client.generate(prompt_ids, max_tokens=n, num_speculative_tokens=k)
                    record(system, time.perf_counter() - start, r.token_ids)
                print("split done for a prompt", flush=True)
    finally:
        serve.terminate()
        serve.wait(timeout=60)

    engine = LocalEngine(str(target_dir), str(draft_dir), num_speculative_tokens=4, num_kv_blocks=args.kv_blocks)
    for prompt_ids in ids:
        start = time.perf_counter()
        r = asyncio.run(engine.generate(prompt_ids, SamplingParams(max_tokens=n, num_speculative_tokens=4)))
        record("in_process_speculative_k4", time.perf_counter() - start, r.token_ids)

    def trim(out):  # transformers keeps generating ids after EOS only when told; stop at EOS like the services
        eos = tokenizer.eos_token_id
        return out[: out.index(eos) + 1] if eos in out else out

    reference = [trim(t) for t in tokens["transformers"]]
    mismatched = [i for i, (a, b) in enumerate(zip(tokens["split_speculative_k4"], reference)) if a != b]
    total_tokens = {s: sum(len(trim(t)) for t in outs) for s, outs in tokens.items()}
    base = total_tokens["split_target_only"] / sum(times["split_target_only"])
    rows = []
    for system in times:
        tps = total_tokens[system] / sum(times[system])
        rows.append({"system": system, "tokens_per_s": tps, "vs_split_target_only": tps / base,
                     "identical_to_transformers_greedy": all(trim(a) == b for a, b in zip(tokens[system], reference))})
    return rows, {"mismatched_prompts_split_vs_transformers": mismatched}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--acceptance-prompts", type=int, default=164)
    parser.add_argument("--prose-prompts", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--speed-prompts", type=int, default=10)
    parser.add_argument("--speed-max-tokens", type=int, default=64)
    parser.add_argument("--skip-acceptance", action="store_true")
    parser.add_argument("--kv-blocks", type=int, default=512, help="KV blocks per model (16 tokens each)")
    args = parser.parse_args()
    target_dir, draft_dir = resolve_model(TARGET), resolve_model(DRAFT)
    extra = {"target": TARGET, "draft": DRAFT, "dtype": "float32", "args": vars(args)}
    if not args.skip_acceptance:
        rows, mismatches = acceptance_part(args, target_dir, draft_dir)
        write_results("real_pair_acceptance_cpu", rows, {**extra, "greedy_mismatches_vs_target_only": mismatches})
        print_table(rows, ["prompts", "temperature", "k", "acceptance", "tokens_per_round", "identical_to_target_only"])
    rows, notes = speed_part(args, target_dir, draft_dir)
    write_results("real_pair_speed_cpu", rows, {**extra, **notes})
    print_table(rows, ["system", "tokens_per_s", "vs_split_target_only", "identical_to_transformers_greedy"])


if __name__ == "__main__":
    main()
