"""The prompt-lookup (n-gram) proposer against the 0.5B model draft and the target alone, real pair on the CPU.

Qwen2.5-Coder-1.5B-Instruct (float32) as the target, greedy, batch 1 (one request at a time), in one process, on
three workloads of `--prompts` prompts each, `--max-tokens` new tokens (or fewer at end of text):
- code: HumanEval prompts (a signature and docstring each), raw completion;
- prose: Shakespeare passages, raw completion;
- edit: the instruct model asked (chat template) to rename a HumanEval function (its prompt + canonical solution)
  and its first parameter and change nothing else: the answer is mostly a copy of the prompt.
Configurations, all on one loaded target (packed weights) and interleaved per prompt (each prompt runs under every
configuration in turn, so load from elsewhere falls on all alike): the target alone, the 0.5B draft at k = 4 (int8
weights), the n-gram proposer (`--ngram-max`/`--ngram-min`) at k = 4 and k = 8, k fixed in every round. Afterwards,
alone, the target loaded again with dense weights (its fastest layout for one row) as a second baseline.

Per configuration and workload: acceptance rate (accepted / proposed), mean accepted tokens per round with a
proposal, the share of rounds with a proposal (the n-gram proposer finds no match in the others), tokens per round
(all rounds), and decode speed (tokens after the first / time after the first token, summed over the prompts, so
prompt prefill and prefix-cache hits do not count). Greedy output of every configuration must equal the target
alone's (checked, recorded).

    flock /work/heavy.lock python bench/bench_ngram_cpu.py [--prompts 3] [--max-tokens 80]
"""

import argparse
import asyncio
import gc
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import commit, print_table, write_results  # noqa: E402
from prompts import humaneval_problems, humaneval_prompts, shakespeare_prompts  # noqa: E402
from specsplit.services.coordinator.coordinator import Coordinator, CoordinatorConfig  # noqa: E402
from specsplit.services.coordinator.generation import GenerationRequest  # noqa: E402
from specsplit.services.coordinator.replica_pools import ReplicaPool  # noqa: E402
from specsplit.services.coordinator.worker_clients import LocalDraftClient, LocalTargetClient  # noqa: E402
from specsplit.services.draft.ngram_proposer import NgramProposer  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.models.prepare import resolve_model  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402
from specsplit.services.tokenization import encode_prompt  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
EDIT_INSTRUCTION = ("Rename this function to `solution` and its first parameter to `data`. Change nothing else: keep "
                    "the docstring and the code exactly as they are. Reply with the whole function in one code block."
                    "\n\n```python\n{code}```")


def workloads(n: int) -> dict[str, list[tuple[str, bool]]]:
    """name -> [(prompt text, apply the chat template)]."""
    problems = humaneval_problems()
    # Functions of a few hundred characters (about 100-200 tokens): the answer fills the token budget.
    functions = [f for f in (p["prompt"] + p["canonical_solution"] for p in problems) if 400 <= len(f) <= 800][:n]
    return {  # editing first: the workload prompt lookup is for
        "edit": [(EDIT_INSTRUCTION.format(code=f), True) for f in functions],
        "code": [(p["prompt"], False) for p in humaneval_prompts(n)],
        "prose": [(p["prompt"], False) for p in shakespeare_prompts(n, 600, seed=0)],
    }


def run(coordinator, tokenizer, prompts, max_tokens: int, k: int | None):
    """One request at a time (batch 1); k None = the coordinator's adaptive choice."""
    params = SamplingParams(max_tokens=max_tokens, num_speculative_tokens=k)

    async def main():
        results = []
        for text, chat in prompts:
            results.append(await coordinator.generate(GenerationRequest(encode_prompt(tokenizer, text, chat), params)))
            await coordinator.wait_idle()
        return results

    return asyncio.run(main())


def summary(results) -> dict:
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    rounds = sum(r.stats.rounds for r in results)
    proposing = sum(r.stats.drafted_per_position[0] for r in results if r.stats.drafted_per_position)
    decode_tokens = sum(len(r.token_ids) - 1 for r in results)
    decode_s = sum(r.total_time - r.time_to_first_token for r in results)
    return {
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "accepted_per_proposing_round": round(accepted / proposing, 3) if proposing else None,
        "rounds_with_proposal": round(proposing / rounds, 3) if rounds else None,
        "tokens_per_round": round(sum(len(r.token_ids) - 1 for r in results) / rounds, 3) if rounds else None,
        "decode_tokens_per_s": round(decode_tokens / decode_s, 3),
        "completion_tokens": sum(len(r.token_ids) for r in results),
        "drafted": drafted, "accepted": accepted, "rounds": rounds,
    }


def report(results: dict, args, final: bool) -> None:
    """Rows from the runs so far (every finished workload), printed and written; rewritten after each workload, so
    a run cut short keeps what it measured."""
    results = {key: rs for key, rs in results.items() if rs}
    rows = [{"config": name, "workload": workload, **summary(rs)} for (name, workload), rs in results.items()]
    outputs = {key: [r.token_ids for r in rs] for key, rs in results.items()}

    baseline = {row["workload"]: row["decode_tokens_per_s"] for row in rows if row["config"] == "target only (packed)"}
    for row in rows:
        row["speedup_vs_target_only"] = round(row["decode_tokens_per_s"] / baseline[row["workload"]], 3)
        row["output_identical_to_target_only"] = (outputs[row["config"], row["workload"]]
                                                  == outputs["target only (packed)", row["workload"]])
    if final:
        print_table(rows, ["workload", "config", "acceptance_rate", "accepted_per_proposing_round", "rounds_with_proposal",
                           "tokens_per_round", "decode_tokens_per_s", "speedup_vs_target_only",
                           "output_identical_to_target_only"])
    path = write_results("ngram_cpu", rows, {
        "models": {"target": args.target, "draft": args.draft, "dtype": "float32",
                   "weights": "target packed (dense in the 'dense, after' row), draft int8"},
        "ngram": {"max": args.ngram_max, "min": args.ngram_min},
        "complete": final, "prompts_per_workload": args.prompts, "max_tokens": args.max_tokens, "greedy": True, "batch": 1,
        "edit_instruction": EDIT_INSTRUCTION,
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "note": "decode_tokens_per_s excludes each request's first token (its prompt's prefill); configurations "
                "interleaved per prompt on one loaded target (packed weights); speedup_vs_target_only is against the "
                "packed target-only row of the same run; the dense target-only row ran afterwards, alone. One shared "
                "2-core machine with other work beside it: ratios within this run are what the numbers are for",
    })
    print(f"wrote {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--target", default=TARGET, help="target MODEL (default: the real pair's)")
    parser.add_argument("--draft", default=DRAFT, help="draft MODEL (default: the real pair's)")
    parser.add_argument("--configs", default="target,draft4,ngram4,ngram8",
                        help="of target (alone), draft4 (0.5B draft, k=4), ngram4, ngram8 (n-gram proposer, k=4 / 8)")
    parser.add_argument("--no-dense-baseline", dest="dense_baseline", action="store_false",
                        help="skip the target-only run with dense weights (a second load of the target)")
    args = parser.parse_args()
    os.environ.setdefault("SPECSPLIT_COMMIT", commit())  # the code as it was loaded, whatever changes meanwhile
    loads = workloads(args.prompts)
    target_dir, draft_dir = str(resolve_model(args.target)), str(resolve_model(args.draft))

    # Speculative configurations: one target (packed weights), the model draft, and n-gram coordinators beside it.
    engine = LocalEngine(target_dir, draft_dir, num_speculative_tokens=4, speculation="fixed")
    tokenizer, eos = engine.tokenizer, engine.target.config.eos_token_ids

    def ngram_coordinator(k: int, speculation: str) -> Coordinator:
        proposer = NgramProposer(args.ngram_max, args.ngram_min)
        return Coordinator(ReplicaPool("target", [LocalTargetClient(engine.verifier)]),
                           [ReplicaPool("ngram", [LocalDraftClient(proposer, name="ngram")])], tokenizer, eos,
                           CoordinatorConfig(num_speculative_tokens=k, speculation=speculation))

    every = {
        "target": ("target only (packed)", engine.coordinator, 0),
        "draft4": ("draft 0.5B, k=4", engine.coordinator, 4),
        "ngram4": ("ngram, k=4", ngram_coordinator(4, "fixed"), 4),
        "ngram8": ("ngram, k=8", ngram_coordinator(8, "fixed"), 8),
    }
    configs = [every[name] for name in args.configs.split(",")]
    for _, coordinator, k in configs:
        run(coordinator, tokenizer, loads["code"][:1], 4, k)  # first-call costs
    # Interleaved: each prompt under every configuration in turn, so load from elsewhere on the machine falls on
    # all of them alike.
    results = {(name, workload): [] for name, _, _ in configs for workload in loads}
    for workload, prompts in loads.items():
        for prompt in prompts:
            for name, coordinator, k in configs:
                results[name, workload] += run(coordinator, tokenizer, [prompt], args.max_tokens, k)
        print(f"{workload} done", flush=True)
        report(results, args, final=False)
    del engine, configs, every
    gc.collect()
    if args.dense_baseline:  # the target alone in its fastest layout for one row, after the rest (not interleaved)
        alone = LocalEngine(target_dir, None, num_speculative_tokens=0)
        run(alone.coordinator, tokenizer, loads["code"][:1], 4, 0)
        for workload, prompts in loads.items():
            results["target only (dense, after)", workload] = run(alone.coordinator, tokenizer, prompts, args.max_tokens, 0)
    report(results, args, final=True)


if __name__ == "__main__":
    main()
