"""Resident memory of the packed (oneDNN) CPU target weights over a long run of changing row counts.

The 1.5B target's linear shapes (qkv 1536->2048, o 1536->1536, gate/up 1536->17920, down 8960->1536 and the
vocabulary projection 1536->151936, random float32 weights: the caches are keyed by shapes, not values) run a
seeded schedule of steps like a serving target's: mostly verifications of batch x (k+1) rows (every row through
the vocabulary projection), some prefills of up to 512 rows (one row per sequence through the projection). Each
configuration runs in its own process (the cache capacities are read once per process); RSS is sampled as it goes.

- unbounded: oneDNN's and ideep's default caches (1024 primitives each): before the fix;
- bounded: the default of services/models/weight_formats.py (16 primitives each);
- bounded_64: 64 primitives each;
- dense: torch's own layout, for reference.

    python bench/bench_packed_memory.py [--steps 200] [--configs unbounded,bounded,bounded_64,dense] [--name _long]
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SHAPES = [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536)]  # one decoder layer's linears (in, out)
VOCAB = 151936
CONFIGS = {
    "unbounded": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"},
    "bounded": {},
    "bounded_64": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"},
    "dense": {"DENSE": "1"},
}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def schedule(steps: int, seed: int = 0) -> list[tuple[int, int]]:
    """(rows through the layers, rows through the vocabulary projection) per step."""
    rng = random.Random(seed)
    plan = []
    for _ in range(steps):
        if rng.random() < 0.15:  # a prefill of 1-4 prompts
            sequences = rng.randint(1, 4)
            plan.append((rng.randint(16, 512), sequences))
        else:  # a verification: batch x (k + 1) rows, every one needs a distribution
            rows = rng.randint(1, 12) * rng.randint(3, 7)
            plan.append((rows, rows))
    return plan


def child(steps: int) -> dict:
    import torch
    from torch import nn

    import specsplit.services.models.weight_formats as weight_formats

    torch.manual_seed(0)
    convert = (lambda linear: linear) if os.environ.get("DENSE") else weight_formats.PackedLinear
    with torch.no_grad():
        layers = [convert(nn.Linear(i, o, bias=False)) for i, o in SHAPES]
        head = convert(nn.Linear(1536, VOCAB, bias=False))
    start = rss_mb()
    samples, times = [], []
    for n, (rows, head_rows) in enumerate(schedule(steps)):
        x = torch.randn(rows, 1536)
        began = time.perf_counter()
        with torch.no_grad():
            h = layers[0](x)[:, :1536]
            h = layers[1](h)
            g = layers[2](h)[:, :8960]
            h = layers[3](g)
            head(h[-head_rows:])
        times.append(time.perf_counter() - began)
        if n % 10 == 0 or n == steps - 1:
            samples.append((n, round(rss_mb() - start, 1)))
    half = len(samples) // 2
    return {
        "rss_after_load_mb": round(start, 1),
        "growth_mb_by_step": samples,
        "growth_mb_end": samples[-1][1],
        "growth_mb_max": max(g for _, g in samples),
        "growth_mb_second_half": round(samples[-1][1] - samples[half][1], 1),
        "step_ms_median": round(1000 * statistics.median(times), 1),
        "step_ms_mean": round(1000 * statistics.fmean(times), 1),
        "distinct_row_counts": len({r for r, _ in schedule(steps)} | {h for _, h in schedule(steps)}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--name", default="", help="suffix of the results file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(child(args.steps)))
        return
    from bench_common import print_table, write_results

    rows = []
    for name in args.configs.split(","):
        env = {**os.environ, **CONFIGS[name]}
        if name == "bounded":  # the module's own defaults, whatever the caller's environment
            env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
            env.pop("LRU_CACHE_CAPACITY", None)
        out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps), "--threads", str(args.threads)],
                             env=env, check=True, capture_output=True, text=True).stdout
        rows.append({"config": name, **json.loads(out.strip().splitlines()[-1])})
        print(name, {k: v for k, v in rows[-1].items() if k != "growth_mb_by_step"}, flush=True)
    print_table(rows, ["config", "rss_after_load_mb", "growth_mb_end", "growth_mb_max", "growth_mb_second_half", "step_ms_median", "step_ms_mean"])
    path = write_results(f"packed_memory{args.name}", rows, {"steps": args.steps, "threads": args.threads, "shapes": SHAPES, "vocab": VOCAB})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
