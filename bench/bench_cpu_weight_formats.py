"""CPU weight formats (services/models/weight_formats.py), side by side in one run.

Default: the real pair's step time through ModelRunner for each format and query length — the target (1.5B) dense
and packed at 1, 5 and 7 new tokens (a decode, a k=4 and a k=6 verification), the draft (0.5B) dense and int8 at 1
and 2 (a draft step, a bonus-token catch-up) — after a 200-token prompt, median of `--repeats`.
`--matrix`: one 1.5B gate/up weight (17920 x 1536) as torch's dense F.linear and packed with several row hints,
for 1 to 64 rows: how the packing hint trades between row counts.

    python bench/bench_cpu_weight_formats.py [--matrix] [--repeats 8]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from specsplit.services.models.loader import load_model  # noqa: E402
from specsplit.services.models.weight_formats import use_weight_format  # noqa: E402
from specsplit.services.runtime.model_runner import ForwardItem, ModelRunner  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPT_LEN = 200


def median_ms(fn, repeats: int) -> float:
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1000 * statistics.median(samples)


def step_rows(model: str, role: str, weight_format: str, query_lens: list[int], repeats: int) -> list[dict]:
    loaded = load_model(model, "float32")
    use_weight_format(loaded, weight_format, role)
    runner = ModelRunner(loaded, num_blocks=64)
    table = runner.block_manager.allocate(0)
    prompt = ForwardItem(table, list(range(1000, 1000 + PROMPT_LEN)), 1)
    runner.reserve([prompt])
    runner.forward([prompt])

    def step(n):
        def run():
            item = ForwardItem(table, [5] * n, n)
            runner.reserve([item])
            runner.forward_flat([item])
            runner.block_manager.truncate(table, PROMPT_LEN)
        return run

    return [{"model": model, "format": weight_format, "new_tokens": n, "ms": median_ms(step(n), repeats)}
            for n in query_lens]


def matrix_rows(repeats: int) -> list[dict]:
    weight = torch.randn(17920, 1536) * 0.02
    inputs = {rows: torch.randn(rows, 1536) for rows in (1, 2, 5, 7, 16, 64)}
    results = [{"layout": "dense", "rows": rows, "ms": median_ms(lambda x=x: torch.nn.functional.linear(x, weight), repeats)}
               for rows, x in inputs.items()]
    for hint in (1, 5, 16, 64):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
        for rows, x in inputs.items():
            ms = median_ms(lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), repeats)
            results.append({"layout": f"packed hint {hint}", "rows": rows, "ms": ms})
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--matrix", action="store_true")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    if args.matrix:
        rows = matrix_rows(args.repeats * 4)
        write_results("cpu_weight_formats_matrix", rows)
        print_table(rows, ["layout", "rows", "ms"])
        return
    rows = []
    for weight_format in ("dense", "packed"):
        rows += step_rows(TARGET, "target", weight_format, [1, 5, 7], args.repeats)
    for weight_format in ("dense", "int8"):
        rows += step_rows(DRAFT, "draft", weight_format, [1, 2], args.repeats)
    dense_decode = next(r["ms"] for r in rows if r["model"] == TARGET and r["format"] == "dense" and r["new_tokens"] == 1)
    for row in rows:
        row["vs_dense_target_decode"] = row["ms"] / dense_decode
    write_results("cpu_weight_formats", rows, {"prompt_tokens": PROMPT_LEN, "dtype": "float32"})
    print_table(rows, ["model", "format", "new_tokens", "ms", "vs_dense_target_decode"])


if __name__ == "__main__":
    main()
