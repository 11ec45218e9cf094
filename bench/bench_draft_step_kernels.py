"""The draft's one-row step, kernel by kernel where this issue changes it (issue 28): the q/k/v projection with
rotary and the KV write in its epilogue against the two kernels it replaces, and the one-query paged attention's
tiles at the contexts a draft sees. Qwen2.5-0.5B shapes (14 query heads, 2 KV heads, head_dim 64, hidden 896),
random bf16 weights and KV; one GPU.

1. Correctness on the device first: the fused q/k/v kernel's q and cache against norm_linear + rotary_kv (within a
   bf16 rounding), every attention tile configuration against the default's output (within bf16 tolerance).
2. Device time per call from CUDA-graph replays of back-to-back calls (as a step runs), inputs rotated over copies
   that exceed L2 for the weights (the KV of a draft's context is small and was just written: it stays in L2, as in
   a step).

Writes $OUT/draft_step_kernels.json (else bench/results/):
    python3 bench/bench_draft_step_kernels.py [--contexts 32,64,128,256,512,1024]
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from bench_kernels import graph_us  # noqa: E402
from specsplit.kernels.paged_attention_triton import paged_attention_triton  # noqa: E402
from specsplit.kernels.rotary_kv import rotary_table  # noqa: E402
from specsplit.kernels.rotary_kv_triton import rotary_kv_triton  # noqa: E402
from specsplit.kernels.skinny_linear_triton import norm_linear_triton, norm_qkv_rotary_triton  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, BLOCK_SIZE = 14, 2, 64, 896, 16
WEIGHT_COPIES = 64  # 64 x 2.1 MB of q/k/v weights: past the L2


def log(*args):
    print(*args, flush=True)


def qkv_rows() -> list[dict]:
    torch.manual_seed(0)
    n = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    weights = [torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5 for _ in range(WEIGHT_COPIES)]
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    norm_weight = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    inv_freq = 1.0 / (1000000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    cos_sin = rotary_table(inv_freq, 1.0, 4096).cuda()
    positions = torch.tensor([1000], device="cuda")
    slots = torch.tensor([77], device="cuda")
    caches = [torch.zeros(64, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(4)]

    def fused(w):
        return norm_qkv_rotary_triton(x, residual, norm_weight, 1e-6, w, bias, positions, cos_sin, caches[0],
                                      caches[1], slots, HEADS, KV_HEADS, HEAD_DIM)[0]

    def unfused(w):
        qkv = norm_linear_triton(x, residual, norm_weight, 1e-6, w, bias)[0]
        return rotary_kv_triton(qkv, positions, cos_sin, caches[2], caches[3], slots, HEADS, KV_HEADS, HEAD_DIM)

    q_fused, q_unfused = fused(weights[0]), unfused(weights[0])
    torch.cuda.synchronize()
    q_error = ((q_fused.float() - q_unfused.float()).abs().max()).item()
    cache_error = max((caches[i].float() - caches[i + 2].float()).abs().max().item() for i in (0, 1))
    ok = q_error <= 2**-6 * max(1.0, q_unfused.float().abs().max().item()) and cache_error <= 2**-6 * 8
    log(f"qkv + rotary: max |fused - unfused| q {q_error:.2e}, cache {cache_error:.2e}: {'ok' if ok else 'WRONG'}")
    rows = []
    for name, fn in (("norm_linear + rotary_kv", unfused), ("norm_qkv_rotary (fused)", fused)):
        state = {"i": 0}

        def call(fn=fn):
            fn(weights[state["i"] % WEIGHT_COPIES])
            state["i"] += 1

        us = graph_us(call, WEIGHT_COPIES)
        rows.append({"part": "qkv", "variant": name, "us": round(us, 2), "correct": ok,
                     "max_q_error": q_error, "max_cache_error": cache_error})
        log(f"qkv {name}: {us:.2f} us")
    return rows


def attention_rows(contexts: list[int]) -> list[dict]:
    rows = []
    configs = [None] + list(itertools.product((16, 32, 64), (1, 2, 4), (1, 2, 3)))
    for context in contexts:
        torch.manual_seed(context)
        blocks = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
        key_cache = torch.randn(blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        value_cache = torch.randn_like(key_cache)
        block_table = torch.randperm(blocks + 1, device="cuda")[:blocks].int()[None, :]
        q = torch.randn(1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        seq_lens = torch.tensor([context], device="cuda", dtype=torch.int32)
        starts = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        default = paged_attention_triton(q, key_cache, value_cache, block_table, seq_lens, starts, HEAD_DIM**-0.5, 1,
                                         context).clone()
        for config in configs:
            knobs = {} if config is None else dict(block_n=config[0], num_warps=config[1], num_stages=config[2])
            try:
                got = paged_attention_triton(q, key_cache, value_cache, block_table, seq_lens, starts,
                                             HEAD_DIM**-0.5, 1, context, out=out, **knobs)
                torch.cuda.synchronize()
            except Exception as error:  # a tile the compiler refuses: recorded, not timed
                rows.append({"part": "attention", "context": context, **knobs, "error": repr(error)[:200]})
                continue
            correct = torch.allclose(got.float(), default.float(), rtol=2e-2, atol=2e-2)
            us = graph_us(lambda: paged_attention_triton(q, key_cache, value_cache, block_table, seq_lens, starts,
                                                         HEAD_DIM**-0.5, 1, context, out=out, **knobs), 32)
            rows.append({"part": "attention", "context": context, "variant": "default" if config is None else
                         f"block_n {config[0]}, {config[1]} warps, {config[2]} stages", **knobs,
                         "us": round(us, 2), "correct": correct})
        timed = [r for r in rows if r.get("context") == context and "us" in r]
        best = min(timed, key=lambda r: r["us"])
        log(f"attention context {context}: default {timed[0]['us']:.2f} us, best {best['us']:.2f} ({best['variant']})")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="32,64,128,256,512,1024")
    args = parser.parse_args()
    rows = qkv_rows() + attention_rows([int(c) for c in args.contexts.split(",")])
    print_table([r for r in rows if "us" in r and (r["part"] == "qkv" or r["variant"] == "default"
                                                   or r["us"] == min(x["us"] for x in rows if x.get("context") ==
                                                                     r.get("context") and "us" in x))],
                ["part", "context", "variant", "us", "correct"])
    write_results("draft_step_kernels", rows, {"gpu": torch.cuda.get_device_name(), "shapes": "Qwen2.5-0.5B, bf16"})


if __name__ == "__main__":
    main()
