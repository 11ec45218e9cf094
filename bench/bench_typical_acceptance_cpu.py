"""Typical acceptance (NOT lossless) against rejection sampling on the real pair, CPU, in one process.

Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct (float32, default weight formats), k = 4, the
first `--prompts` HumanEval prompts, `--max-tokens` each, sampled at temperature 0.7 and 1.0 (seed = prompt index,
the same for both methods), plus greedy as a check that both methods emit the target's tokens there.
One engine serves every configuration: its target allows typical acceptance per request, so each request picks
its method and the two are measured on the same loaded models, one configuration after the other (the prompts of
a configuration run `--concurrency` at a time, one batch per round; the warm-up puts every prompt in the prefix
cache, so no configuration pays the prefills).

Records per configuration: acceptance rate (accepted / drafted), tokens per speculative round (accepted + 1 per
round, the quantity speed follows), acceptance per position, and how many output tokens match the rejection
sampling run of the same seed (typical output is not the target's distribution, so they drift apart).

    python bench/bench_typical_acceptance_cpu.py [--prompts 6] [--max-tokens 64] [--concurrency 6]
"""

import argparse
import asyncio
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from prompts import humaneval_prompts  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.models.prepare import resolve_model  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402
from specsplit.services.target.acceptance_method import AcceptancePolicy  # noqa: E402
from specsplit.services.telemetry.confidence_intervals import wilson  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
K = 4


def run_config(engine, prompts, temperature: float, method: str, max_tokens: int, concurrency: int):
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True,
                             num_speculative_tokens=K, speculation="fixed", acceptance_method=method)
              for i in range(len(prompts))]

    async def main():
        start, results = time.perf_counter(), []
        for first in range(0, len(prompts), concurrency):
            chunk = range(first, min(first + concurrency, len(prompts)))
            results += await asyncio.gather(*(engine.generate(prompts[i], params[i]) for i in chunk))
            await engine.coordinator.wait_idle()
        return results, time.perf_counter() - start

    return asyncio.run(main())


def summary(results) -> dict:
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    # Speculative rounds (the draft proposed): the rounds with a proposal at position 0.
    rounds = sum(r.stats.drafted_per_position[0] for r in results if r.stats.drafted_per_position)
    per_position = [
        sum(r.stats.accepted_per_position[i] for r in results if len(r.stats.accepted_per_position) > i)
        / max(1, sum(r.stats.drafted_per_position[i] for r in results if len(r.stats.drafted_per_position) > i))
        for i in range(K)
    ]
    return {
        "acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_rate_ci95": [round(x, 4) for x in wilson(accepted, drafted)] if drafted else None,
        "tokens_per_round": (accepted + rounds) / rounds if rounds else None,
        "drafted": drafted, "accepted": accepted, "speculative_rounds": rounds,
        "acceptance_per_position": [round(x, 4) for x in per_position],
        "completion_tokens": sum(len(r.token_ids) for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--concurrency", type=int, default=6, help="requests at a time (memory grows with it)")
    args = parser.parse_args()

    policy = AcceptancePolicy(allow_typical_per_request=True)  # defaults: threshold 0.09, alpha 0.3
    engine = LocalEngine(str(resolve_model(TARGET)), str(resolve_model(DRAFT)), num_speculative_tokens=K,
                         acceptance=policy)
    prompts = [p["prompt"] for p in humaneval_prompts(args.prompts)]
    # Warm-up: first-call costs, and every prompt's KV into the prefix cache.
    run_config(engine, prompts, 0.0, "rejection", 2, args.concurrency)

    rows, outputs = [], {}
    for temperature in [0.0] + [float(t) for t in args.temperatures.split(",")]:
        for method in ("rejection", "typical"):
            results, seconds = run_config(engine, prompts, temperature, method, args.max_tokens, args.concurrency)
            assert all(r.acceptance_method == method for r in results)
            outputs[temperature, method] = [r.token_ids for r in results]
            reference = outputs[temperature, "rejection"]
            same = sum(a == b for got, ref in zip(outputs[temperature, method], reference) for a, b in zip(got, ref))
            rows.append({
                "temperature": temperature, "method": method, "lossless": method == "rejection",
                **summary(results),
                "tokens_identical_to_rejection_run": same,
                "wall_s": round(seconds, 2),
                "tokens_per_s_batch": round(sum(len(r.token_ids) for r in results) / seconds, 2),
            })
            print(f"T={temperature} {method}: {rows[-1]['acceptance_rate']:.3f} accepted, "
                  f"{rows[-1]['tokens_per_round']:.2f} tokens/round", flush=True)
    greedy_equal = outputs[0.0, "typical"] == outputs[0.0, "rejection"]
    print_table(rows, ["temperature", "method", "acceptance_rate", "acceptance_rate_ci95", "tokens_per_round",
                       "tokens_identical_to_rejection_run", "wall_s", "tokens_per_s_batch"])
    print(f"greedy output identical under both methods: {greedy_equal}")
    path = write_results("typical_acceptance_cpu", rows, {
        "models": {"target": TARGET, "draft": DRAFT, "dtype": "float32", "weights": "target packed, draft int8"},
        "k": K, "prompts": f"HumanEval[:{args.prompts}]", "max_tokens": args.max_tokens, "concurrency": args.concurrency,
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "typical_parameters": {"posterior_threshold": policy.posterior_threshold, "posterior_alpha": policy.posterior_alpha},
        "greedy_output_identical": greedy_equal,
        "note": "typical acceptance is NOT lossless; acceptance_rate_ci95 is a Wilson interval over drafted tokens "
                "(they are not independent: an indication only). Greedy rows are the control: both methods emit the "
                "same tokens there, and their acceptance differs only by run-to-run variation of the draft's "
                "proposals. wall_s and tokens_per_s_batch are for all prompts at once (one batch per round) on a "
                "shared 2-core machine, the first configuration including the prompts' prefill: indicative only",
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
