"""The batch-invariant mode (--batch-invariant) on one GPU: correctness first, then what it costs, side by side with
the default mode in the same process. Random-weight Qwen2.5 shapes, bf16 (models built as bench_gpu_e2e.py does).

1. Correctness. A 7B-shaped target and an unrelated 0.5B-shaped draft, greedy, 64 prompts of 32 random tokens,
   `--check-tokens` tokens each. Reference: the target alone, each prompt at batch 1. At every batch of
   `--check-batches`, target-only decoding and speculation with k = 4 (fixed) must give every sequence its reference
   tokens in the mode; so must adaptive k at the largest batch, and the 7B drafting for itself must have every
   proposal accepted (the draft's one-row steps and the target's k+1-row verification agree bit for bit). The
   default mode's counts are reported beside them for contrast.
2. Speed. Target-only decoding and speculation (SYNTHETIC acceptance alpha = 0.7, k = 4: NOT lossless, a benchmark
   mode, services/target/synthetic_acceptance.py) in tokens/s at each of `--batches`, the two modes' engines run
   in turns; `mode_vs_default` = the mode's tokens/s / the default's (issue 30's goal: >= 0.85 at batch 1-32).

Writes $OUT/batch_invariant.json (else bench/results/). From the repository root, one GPU:
    python3 bench/bench_batch_invariant.py [--batches 1,8,32] [--check-batches 1,8,32,64]
The mode's GEMM against cuBLAS per weight shape: bench/bench_invariant_gemm.py.
A smoke run on the CPU (tiny models): SPECSPLIT_BENCH_DEVICE=cpu SPECSPLIT_BENCH_VOCAB=257
    python3 bench/bench_batch_invariant.py --target-size tiny --draft-size tiny --check-batches 1,4 --batches 1
"""

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import bench_gpu_e2e  # noqa: E402
from bench_common import print_table, write_results  # noqa: E402
from bench_gpu_e2e import DEVICE, K, hf_random_model, loaded_from_hf, prompts, run_local  # noqa: E402
from specsplit.kernels.dispatch import set_batch_invariant  # noqa: E402
from specsplit.services.coordinator.coordinator import CoordinatorConfig  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402

ALPHA = 0.7
MODES = {False: "default", True: "batch_invariant"}
RESULTS: dict = {"rows": []}


def log(*args):
    print(*args, flush=True)


def engine(target, draft, mode: bool, speculation: str = "fixed") -> LocalEngine:
    """An engine whose CUDA graphs are captured in `mode` (graphs keep the kernels of the mode they were taken in)."""
    set_batch_invariant(mode)
    return LocalEngine(target, draft, num_speculative_tokens=K, prefix_caching=False,
                       coordinator_config=CoordinatorConfig(max_num_seqs=256, speculation=speculation))


def greedy_tokens(eng: LocalEngine, prompt_ids: list[list[int]], k: int | None, max_tokens: int):
    """Token ids and acceptance counts of greedy requests run at once (k None: the engine's policy chooses)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k, temperature=0.0)

    async def main():
        results = await asyncio.gather(*(eng.generate(p, params) for p in prompt_ids))
        await eng.coordinator.wait_idle()
        return results

    results = asyncio.run(main())
    return ([r.token_ids for r in results], sum(r.stats.accepted_tokens for r in results),
            sum(r.stats.draft_tokens for r in results))


def correctness(target, draft, check_batches: list[int], max_tokens: int) -> dict:
    all_prompts = prompts(max(check_batches))
    summary = {}
    for mode in (True, False):
        name = MODES[mode]
        t0 = time.perf_counter()
        alone_engine = engine(target, None, mode)
        reference = [greedy_tokens(alone_engine, [p], 0, max_tokens)[0][0] for p in all_prompts]
        del alone_engine
        _release()
        speculative = engine(target, draft, mode)
        checks = []
        for batch in check_batches:
            for kind, k in (("target_only", 0), (f"k={K}", K)):
                out, accepted, drafted = greedy_tokens(speculative, all_prompts[:batch], k, max_tokens)
                same = sum(a == b for a, b in zip(out, reference))
                checks.append({"mode": name, "batch": batch, "run": kind, "equal_to_target_alone": same,
                               "sequences": batch, "accepted_per_drafted": accepted / drafted if drafted else None})
        del speculative
        _release()
        adaptive = engine(target, draft, mode, speculation="adaptive")
        batch = max(check_batches)
        out, accepted, drafted = greedy_tokens(adaptive, all_prompts[:batch], None, max_tokens)
        checks.append({"mode": name, "batch": batch, "run": "adaptive k", "sequences": batch,
                       "equal_to_target_alone": sum(a == b for a, b in zip(out, reference)),
                       "accepted_per_drafted": accepted / drafted if drafted else None})
        del adaptive
        _release()
        self_draft = engine(target, target, mode)
        batch = min(8, max(check_batches))
        out, accepted, drafted = greedy_tokens(self_draft, all_prompts[:batch], K, max_tokens)
        checks.append({"mode": name, "batch": batch, "run": "the target drafting for itself", "sequences": batch,
                       "equal_to_target_alone": sum(a == b for a, b in zip(out, reference)),
                       "accepted_per_drafted": accepted / drafted})
        del self_draft
        _release()
        for row in checks:
            log(row)
        RESULTS["rows"] += [{"section": "correctness", **row} for row in checks]
        exact = all(r["equal_to_target_alone"] == r["sequences"] for r in checks)
        self_accepted = checks[-1]["accepted_per_drafted"]
        summary[name] = {"every_sequence_equal_to_target_alone": exact,
                         "sequences_equal": sum(r["equal_to_target_alone"] for r in checks),
                         "sequences": sum(r["sequences"] for r in checks),
                         "self_draft_acceptance": self_accepted, "seconds": time.perf_counter() - t0}
        log(name, summary[name])
        RESULTS["correctness"] = summary
        save()  # each mode's rows as soon as they exist: a call cut off in the next mode keeps them
    summary["passed"] = (summary["batch_invariant"]["every_sequence_equal_to_target_alone"]
                         and summary["batch_invariant"]["self_draft_acceptance"] == 1.0)
    return summary


def speed(target, draft, batches: list[int], max_tokens: int) -> list[dict]:
    engines = {mode: engine(target, draft, mode) for mode in (False, True)}
    for mode, eng in engines.items():  # first calls compile kernels and capture graphs
        set_batch_invariant(mode)
        run_local(eng, 2, K, 16)
        run_local(eng, 2, 0, 16)
    rows = []
    for batch in batches:
        for kind, k in (("decode", 0), ("speculative", K)):
            measured = {}
            for mode, eng in engines.items():
                set_batch_invariant(mode)
                eng.verifier.synthetic_acceptance = ALPHA if k else None  # benchmark-only, labelled below
                run_local(eng, batch, k, max_tokens)  # the same run once untimed: nothing left to capture
                measured[mode] = run_local(eng, batch, k, max_tokens)
                eng.verifier.synthetic_acceptance = None
            for mode, run in measured.items():
                row = {"section": "speed", "mode": MODES[mode], "run": kind, "batch": batch, "k": k,
                       "alpha": ALPHA if k else None, "acceptance": "synthetic" if k else None, **run,
                       "mode_vs_default": run["tokens_per_s_total"] / measured[False]["tokens_per_s_total"]}
                rows.append(row)
                log(row)
    del engines
    gc.collect()
    _empty_cache()
    return rows


def _release():
    """Free a dropped engine's KV cache and graph pools now (engines sit in reference cycles)."""
    gc.collect()
    _empty_cache()


def _empty_cache():
    if DEVICE != "cpu":
        torch.cuda.empty_cache()


def save():
    write_results("batch_invariant", RESULTS["rows"], {k: v for k, v in RESULTS.items() if k != "rows"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target-size", default="7b")
    parser.add_argument("--draft-size", default="0.5b")
    parser.add_argument("--check-batches", default="1,8,32,64")
    parser.add_argument("--check-tokens", type=int, default=32)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration; the median is kept")
    parser.add_argument("--skip-correctness", action="store_true", help="speed only (correctness measured already)")
    args = parser.parse_args()
    bench_gpu_e2e.REPEATS = args.repeats
    started = time.perf_counter()
    RESULTS.update({"k": K, "alpha": ALPHA, "dtype": "bfloat16", "max_tokens": args.max_tokens,
                    "models": f"random-weight Qwen2.5 shapes ({args.draft_size} draft, {args.target_size} target)",
                    "acceptance_note": "speed rows with acceptance=synthetic use the NOT-LOSSLESS synthetic mode"})
    hf_draft = hf_random_model(args.draft_size, seed=1)
    draft = loaded_from_hf(hf_draft, f"random-qwen2.5-{args.draft_size}")
    del hf_draft
    hf_target = hf_random_model(args.target_size, seed=2)
    target = loaded_from_hf(hf_target, f"random-qwen2.5-{args.target_size}")
    del hf_target
    gc.collect()
    _empty_cache()
    log(f"models built in {time.perf_counter() - started:.0f}s")

    if not args.skip_correctness:
        RESULTS["correctness"] = correctness(target, draft, [int(b) for b in args.check_batches.split(",")],
                                             args.check_tokens)  # saved after each mode, and with "passed" here
        save()
    RESULTS["rows"] += speed(target, draft, [int(b) for b in args.batches.split(",")], args.max_tokens)
    RESULTS["seconds"] = time.perf_counter() - started
    save()

    print(f"\ncorrectness: {RESULTS.get('correctness', 'not run (--skip-correctness)')}")
    print_table([r for r in RESULTS["rows"] if r["section"] == "correctness"],
                ["mode", "batch", "run", "equal_to_target_alone", "sequences", "accepted_per_drafted"])
    print_table([r for r in RESULTS["rows"] if r["section"] == "speed"],
                ["run", "batch", "mode", "tokens_per_s_total", "mode_vs_default"])
    print(f"total {RESULTS['seconds']:.0f}s")


if __name__ == "__main__":
    main()
