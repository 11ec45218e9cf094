"""The real pair on the CPU: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct (float32).

Everything goes through the split services (`specsplit serve`: three processes over loopback gRPC) with their
default weight formats (target: packed float32, draft: int8; services/models/weight_formats.py).

Part B, speed at batch 1 on the first `--speed-prompts` HumanEval prompts, one system after another in this one
run: transformers `generate` (target alone), transformers assisted generation (`assistant_model=` the draft), the
split services target-only (`serve --draft none`: dense target, the fastest layout for one row) and speculative at
k = 4 and 6, and the in-process engine at k = 4.

Part A, acceptance: HumanEval prompts (code) and Shakespeare passages (prose), k in {2, 4, 6}, greedy and
temperature 0.7, `--concurrency` requests at a time, all on one set of services. Records acceptance rate, tokens per
round and per-position acceptance, and checks greedy speculative output equals the services' target-only output on
every prompt. The workers' prefix caches (kv/prefix_cache.py) keep every prompt's KV from the first configuration
(target-only) for the other twelve, so each prompt is prefilled once, not 13 times; `--kv-blocks` must hold them all.

Part C: transformers' greedy `generate` with the target alone (batch 1, no padding) on every HumanEval prompt of
part A, compared token for token with the services' greedy output (target-only and every k).

    python bench/bench_real_pair_cpu.py [--acceptance-prompts 164] [--prose-prompts 40] [--speed-prompts 5]
"""

import argparse
import asyncio
import gc
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from prompts import humaneval_prompts, shakespeare_prompts  # noqa: E402
from specsplit.client import Client  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.models.prepare import resolve_model  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402
from specsplit.services.service_commands import spawn_service  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


class Services:
    """`specsplit serve` in a child process for the duration of a `with` block (`env`: its environment, None: this
    process's)."""

    def __init__(self, target_dir, draft_dir, kv_blocks: int, *extra: str, env: dict | None = None):
        argv = ["serve", "--target", str(target_dir), "--draft", str(draft_dir) if draft_dir else "none", "--port", "0",
                "--metrics-port", "-1", "-k", "4", "--num-kv-blocks", str(kv_blocks), *extra]
        self.process, self.address = spawn_service(argv, env=env)

    def __enter__(self):
        return self.address

    def __exit__(self, *exc):
        self.process.terminate()
        self.process.wait(timeout=120)


def trim_at_eos(tokens: list[int], eos: int) -> list[int]:
    """transformers pads after EOS in a batch of one only when told; compare up to and including EOS."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def speed_part(args, target_dir, draft_dir, tokenizer) -> tuple[list[dict], dict]:
    from transformers import AutoModelForCausalLM

    ids = [tokenizer.encode(p["prompt"]) for p in humaneval_prompts(args.speed_prompts)]
    n = args.speed_max_tokens
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[list[int]]] = {}

    def record(system, elapsed, out):
        times.setdefault(system, []).append(elapsed)
        tokens.setdefault(system, []).append(trim_at_eos(out, tokenizer.eos_token_id))

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    with torch.no_grad():
        target.generate(torch.tensor([ids[0]]), max_new_tokens=4, do_sample=False)  # warm-up
        for prompt_ids in ids:
            x = torch.tensor([prompt_ids])
            for system, extra in (("transformers", {}), ("transformers_assisted", {"assistant_model": draft})):
                start = time.perf_counter()
                out = target.generate(x, max_new_tokens=n, do_sample=False, **extra)
                record(system, time.perf_counter() - start, out[0, len(prompt_ids):].tolist())
    print("transformers done", flush=True)
    del target, draft
    gc.collect()

    # Prefix caching off: every system pays each prompt's prefill, as transformers does (the warm-up and the second
    # pass over the same prompts would otherwise find them cached).
    runs = (("split_target_only", None, (0,)), ("split_speculative", draft_dir, (4, 6)))
    for name, draft_path, ks in runs:
        with Services(target_dir, draft_path, args.kv_blocks, "--no-prefix-caching") as address, \
                Client(address, timeout=3600) as client:
            client.generate(ids[0], max_tokens=4)  # warm-up: first calls pay one-time costs
            for k in ks:  # one pass over the prompts per k
                for prompt_ids in ids:
                    start = time.perf_counter()
                    r = client.generate(prompt_ids, max_tokens=n, num_speculative_tokens=k,
                                        speculation="fixed" if k else None)  # exactly k, not at most
                    record(name if k == 0 else f"{name}_k{k}", time.perf_counter() - start, r.token_ids)
        print(name, "done", flush=True)

    engine = LocalEngine(str(target_dir), str(draft_dir), num_speculative_tokens=4, num_kv_blocks=args.kv_blocks,
                         prefix_caching=False)
    asyncio.run(engine.generate(ids[0], SamplingParams(max_tokens=4)))
    for prompt_ids in ids:
        start = time.perf_counter()
        r = asyncio.run(engine.generate(prompt_ids, SamplingParams(max_tokens=n, num_speculative_tokens=4,
                                                                   speculation="fixed")))
        record("in_process_speculative_k4", time.perf_counter() - start, r.token_ids)
    del engine
    gc.collect()

    reference = tokens["transformers"]
    total_tokens = {s: sum(len(t) for t in outs) for s, outs in tokens.items()}
    base = total_tokens["split_target_only"] / sum(times["split_target_only"])
    assisted = total_tokens["transformers_assisted"] / sum(times["transformers_assisted"])
    rows = []
    for system in times:
        tps = total_tokens[system] / sum(times[system])
        rows.append({"system": system, "tokens_per_s": tps, "vs_split_target_only": tps / base,
                     "vs_transformers_assisted": tps / assisted,
                     "identical_to_transformers_greedy": tokens[system] == reference,
                     "mismatched_prompts": [i for i, (a, b) in enumerate(zip(tokens[system], reference)) if a != b]})
    return rows, {"speed_prompts": len(ids), "speed_max_tokens": n}


def run_many(address: str, prompts: list[str], params: dict, concurrency: int) -> list:
    with Client(address, timeout=7200) as client, ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: client.generate(p, **params), prompts))


def acceptance_part(args, target_dir, draft_dir) -> tuple[list[dict], dict]:
    sets = {
        "humaneval": [p["prompt"] for p in humaneval_prompts(args.acceptance_prompts)],
        "shakespeare": [p["prompt"] for p in shakespeare_prompts(args.prose_prompts, 400, seed=0)],
    }
    rows, greedy_outputs, prompt_tokens = [], {}, {}
    with Services(target_dir, draft_dir, args.kv_blocks) as address:
        for name, prompts in sets.items():
            base = run_many(address, prompts, dict(max_tokens=args.max_tokens, num_speculative_tokens=0), args.concurrency)
            greedy_outputs[(name, 0)] = [r.token_ids for r in base]
            prompt_tokens[name] = sum(r.prompt_tokens for r in base)
            for temperature in (0.0, 0.7):
                for k in (2, 4, 6):
                    params = dict(max_tokens=args.max_tokens, num_speculative_tokens=k, temperature=temperature, seed=7,
                                  speculation="fixed")
                    start = time.perf_counter()
                    results = run_many(address, prompts, params, args.concurrency)
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
                        "mean_accepted_length": accepted / rounds if rounds else 0.0,
                        "tokens_per_round": emitted / rounds if rounds else 0.0,
                        "per_position": [round(a / d, 3) if d else None for a, d in zip(per_pos_a, per_pos_d)],
                        "wall_s": elapsed,
                    }
                    if temperature == 0.0:
                        greedy_outputs[(name, k)] = [r.token_ids for r in results]
                        row["identical_to_target_only"] = greedy_outputs[(name, k)] == greedy_outputs[(name, 0)]
                        row["mismatched_prompts_vs_target_only"] = [
                            i for i, (a, b) in enumerate(zip(greedy_outputs[(name, k)], greedy_outputs[(name, 0)])) if a != b
                        ]
                    rows.append(row)
                    print({k2: v for k2, v in row.items() if k2 != "per_position"}, flush=True)
    return rows, greedy_outputs, prompt_tokens


def transformers_check_part(args, target_dir, tokenizer, greedy_outputs) -> dict:
    """transformers' greedy output for every HumanEval prompt of part A, against the services' at every k."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    prompts = [p["prompt"] for p in humaneval_prompts(args.acceptance_prompts)]
    reference = []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = tokenizer.encode(prompt)
            out = target.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False)
            reference.append(trim_at_eos(out[0, len(ids):].tolist(), tokenizer.eos_token_id))
            if i % 20 == 0:
                print(f"transformers reference {i}/{len(prompts)}", flush=True)
    del target
    gc.collect()
    check = {}
    for (name, k), outputs in greedy_outputs.items():
        if name != "humaneval":
            continue
        mismatched = [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]
        check[f"k{k}"] = {"prompts": len(reference), "mismatched_prompts": mismatched,
                          "first_divergence": {i: _first_divergence(outputs[i], reference[i]) for i in mismatched}}
        print(f"transformers check k={k}: {len(reference) - len(mismatched)}/{len(reference)} identical", flush=True)
    return check


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--acceptance-prompts", type=int, default=164)
    parser.add_argument("--prose-prompts", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--speed-prompts", type=int, default=5)
    parser.add_argument("--speed-max-tokens", type=int, default=48)
    parser.add_argument("--parts", default="B,A,C", help="which parts to run, in this order")
    parser.add_argument("--kv-blocks", type=int, default=2560, help="KV blocks per model (16 tokens each)")
    parser.add_argument("--name", default="", help="suffix for the result files")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    target_dir, draft_dir = resolve_model(TARGET), resolve_model(DRAFT)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    extra = {"target": TARGET, "draft": DRAFT, "dtype": "float32", "weights": "target packed, draft int8 (defaults)",
             "args": vars(args)}
    parts = args.parts.split(",")
    if "B" in parts:
        rows, notes = speed_part(args, target_dir, draft_dir, tokenizer)
        write_results("real_pair_speed_cpu" + args.name, rows, {**extra, **notes})
        print_table(rows, ["system", "tokens_per_s", "vs_split_target_only", "vs_transformers_assisted",
                           "identical_to_transformers_greedy"])
    if "A" in parts:
        start = time.perf_counter()
        rows, greedy_outputs, prompt_tokens = acceptance_part(args, target_dir, draft_dir)
        seconds = {"part_A": time.perf_counter() - start}
        check = None
        if "C" in parts:
            start = time.perf_counter()
            check = transformers_check_part(args, target_dir, tokenizer, greedy_outputs)
            seconds["part_C"] = time.perf_counter() - start
        write_results("real_pair_acceptance_cpu" + args.name, rows, {**extra, "greedy_vs_transformers": check,
                                                                     "prompt_tokens": prompt_tokens, "seconds": seconds})
        print_table(rows, ["prompts", "temperature", "k", "acceptance", "mean_accepted_length", "tokens_per_round",
                           "identical_to_target_only"])


if __name__ == "__main__":
    main()
