"""The speculating CPU target's layouts side by side with a draft that helps: packed (the default before the mapped
dual layout) against dual (its dense half the mapped checkpoint), the real pair, `specsplit generate --local`, k = 4
adaptive, greedy, one HumanEval prompt, `--tokens` new tokens, runs taking turns. Tokens per second from the
request's own timing (model loading excluded). The question: does `auto` taking the dual layout cost the
speculating case anything where the draft does pay (its one-row half only runs when the policy picks k = 0).

    python bench/bench_dual_layout_cpu.py [--repeats 2] [--tokens 96]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from prompts import humaneval_prompts  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def generate(layout: str, prompt: str, tokens: int) -> dict:
    argv = [sys.executable, "-m", "specsplit", "generate", "--local", "--target", TARGET, "--draft", DRAFT, "-k", "4",
            "--target-weights", layout, "--prompt", prompt, "--max-tokens", str(tokens), "--ignore-eos", "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=True).stdout
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    return {"tokens_per_s": len(result["token_ids"]) / result["timings"]["total_s"], "token_ids": result["token_ids"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--name", default="dual_layout_cpu")
    args = parser.parse_args()
    prompt = humaneval_prompts(2)[1]["prompt"]
    runs = {"packed": [], "dual": []}
    for _ in range(args.repeats):
        for layout in runs:
            runs[layout].append(generate(layout, prompt, args.tokens))
    assert runs["packed"][0]["token_ids"] == runs["dual"][0]["token_ids"]  # greedy: the same tokens either way
    packed = statistics.median(r["tokens_per_s"] for r in runs["packed"])
    rows = [{"layout": layout, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
             "runs_tokens_per_s": [round(r["tokens_per_s"], 3) for r in rs],
             "vs_packed": statistics.median(r["tokens_per_s"] for r in rs) / packed} for layout, rs in runs.items()]
    write_results(args.name, rows, {"target": TARGET, "draft": DRAFT, "tokens": args.tokens, "k": "adaptive <= 4",
                                    "prompt": "HumanEval/1", "load_avg_1m_at_end": os.getloadavg()[0]})
    print_table(rows, ["layout", "tokens_per_s", "runs_tokens_per_s", "vs_packed"])


if __name__ == "__main__":
    main()
