"""How often prompt lookup would be accepted, on reference continuations instead of a model's output (no model run).

Greedy speculative decoding emits exactly the target's tokens, so the rounds it takes with the n-gram proposer are a
function of the prompt and the output alone: each round proposes `lookup(context, k)`, accepts the longest prefix
that equals the next output tokens, and commits it plus one token. This script replays that with the project's own
`NgramProposer` where the "output" is a reference text, tokenized with the target's tokenizer:
- code: HumanEval prompt -> its canonical solution;
- prose: a Shakespeare passage -> the lines that follow it;
- edit: the rename-this-function request of bench_ngram_cpu.py (chat template) -> the function with the renames
  done and nothing else changed (what a model that obeys answers, in a code block).
It is a PROXY: a real target writes other code and prose than the reference (bench_ngram_cpu.py measures the real
pair); it shows how much of each kind of text prompt lookup can predict, cheaply, for many prompts.

    python bench/bench_ngram_reference_texts.py [--prompts 40] [--tokens 64] [-k 4]
"""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from bench_ngram_cpu import EDIT_INSTRUCTION, TARGET  # noqa: E402
from prompts import humaneval_problems, shakespeare_prompts  # noqa: E402
from specsplit.services.draft.ngram_proposer import NgramProposer  # noqa: E402
from specsplit.services.draft.proposer import DraftPrefill  # noqa: E402
from specsplit.services.models.prepare import resolve_model  # noqa: E402
from specsplit.services.runtime.worker_sequences import WorkerSampling  # noqa: E402
from specsplit.services.tokenization import encode_prompt  # noqa: E402


def pairs(n: int, tokenizer) -> dict[str, list[tuple[list[int], list[int]]]]:
    """workload -> [(prompt ids, reference output ids)]."""
    problems = humaneval_problems()
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    code = [(encode(p["prompt"]), encode(p["canonical_solution"])) for p in problems[:n]]
    prose = []
    for passage in shakespeare_prompts(n, 1200, seed=0):
        lines = passage["prompt"].splitlines(keepends=True)
        half = len(lines) // 2
        prose.append((encode("".join(lines[:half])), encode("".join(lines[half:]))))
    edit = []
    for p in problems:
        function = p["prompt"] + p["canonical_solution"]
        if not 400 <= len(function) <= 800:
            continue
        name = p["entry_point"]
        params = re.search(rf"def {name}\(\s*(\w+)", function)
        answer = function.replace(f"def {name}(", "def solution(")
        if params:
            answer = re.sub(rf"\b{params.group(1)}\b", "data", answer)
        prompt = encode_prompt(tokenizer, EDIT_INSTRUCTION.format(code=function), True)
        edit.append((prompt, encode(f"```python\n{answer.strip()}\n```")))
        if len(edit) == n:
            break
    return {"code": code, "prose": prose, "edit": edit}


def replay(prompt: list[int], output: list[int], k: int, max_n: int, min_n: int) -> tuple[int, int, int, int]:
    """Greedy rounds with the n-gram proposer when the target's output is `output`:
    (rounds, rounds with a proposal, proposed tokens, accepted tokens)."""
    proposer = NgramProposer(max_n, min_n)
    proposer.prefill([DraftPrefill("s", list(prompt) + output[:1], WorkerSampling(0.0, 0, 1.0, 0))])
    sequence = proposer.sequences.get("s")
    position, rounds, proposing, proposed, accepted = 1, 0, 0, 0, 0  # output[0] comes from the prefill
    while position < len(output):
        proposal = proposer.lookup(sequence, min(k, len(output) - position - 1)) if position < len(output) - 1 else []
        hits = 0
        while hits < len(proposal) and proposal[hits] == output[position + hits]:
            hits += 1
        rounds += 1
        proposing += bool(proposal)
        proposed += len(proposal)
        accepted += hits
        committed = output[position : position + hits + 1]
        proposer._append(sequence, committed)
        position += len(committed)
    return rounds, proposing, proposed, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=64, help="reference output tokens per prompt (at most)")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=1)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(TARGET))
    rows = []
    for workload, items in pairs(args.prompts, tokenizer).items():
        totals = [0, 0, 0, 0]
        tokens = 0
        for prompt, output in items:
            output = output[: args.tokens]
            tokens += len(output) - 1
            for i, value in enumerate(replay(prompt, output, args.k, args.ngram_max, args.ngram_min)):
                totals[i] += value
        rounds, proposing, proposed, accepted = totals
        rows.append({
            "workload": workload, "prompts": len(items), "k": args.k,
            "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
            "accepted_per_proposing_round": round(accepted / proposing, 3) if proposing else None,
            "rounds_with_proposal": round(proposing / rounds, 3),
            "tokens_per_round": round(tokens / rounds, 3),
            "target_forwards_saved": round(1 - rounds / tokens, 3),
        })
    print_table(rows, list(rows[0]))
    path = write_results(f"ngram_reference_texts_k{args.k}", rows, {
        "tokenizer": TARGET, "ngram": {"max": args.ngram_max, "min": args.ngram_min}, "tokens": args.tokens,
        "note": "PROXY, no model run: greedy rounds replayed with the n-gram proposer where the target's output is "
                "a reference text (HumanEval canonical solutions, the following Shakespeare lines, the renamed "
                "function); tokens_per_round counts output tokens after the first over all rounds",
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
