"""The few-rows matmul with its fused norm and SiLU (kernels/skinny_linear_triton.py) against the unfused kernels it
replaces, on the weight shapes of the 7B target and the 0.5B draft (random bf16 weights; no model is built).

Per shape and row count (a decode step's one row; 8, where cuBLAS wins):
1. Correctness on the device: the fused result against the unfused one (the residual stream bit for bit, the
   output within bf16 rounding).
2. Device time per call (CUDA-graph replays, as a step runs), weights rotated over copies that together exceed L2
   so every call streams its weight from memory as in a real step: the unfused sequence (add + RMSNorm kernel,
   cuBLAS, SiLU * up kernel) against the fused kernel with `skinny_config`'s tiles and, with --sweep, against other
   tiles (to set skinny_config's rule).
The summary adds each model's layer (qkv with its norm, o, gate/up with its norm and SiLU, down) and its lm_head,
as unfused time / fused time.

Writes $OUT/skinny_linear.json (else bench/results/). One GPU:
    python3 bench/bench_skinny_linear.py [--rows 1,5,8] [--sweep]
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from bench_kernels import graph_us  # noqa: E402
from specsplit.kernels.rms_norm_triton import add_rms_norm_triton  # noqa: E402
from specsplit.kernels.silu_mul_triton import silu_mul_triton  # noqa: E402
from specsplit.kernels.skinny_linear_triton import SkinnyConfig, norm_linear_triton, skinny_config  # noqa: E402

# [N, K] of each model's matmuls (gate/up packed as the engine packs it), with what fuses into each.
SHAPES = {
    "7b": {"qkv": (4608, 3584, "norm", True), "o": (3584, 3584, "", False),
           "gate_up": (37888, 3584, "norm+silu", False), "down": (3584, 18944, "", False),
           "lm_head": (152064, 3584, "", False)},
    "0.5b": {"qkv": (1152, 896, "norm", True), "o": (896, 896, "", False),
             "gate_up": (9728, 896, "norm+silu", False), "down": (896, 4864, "", False),
             "lm_head": (151936, 896, "", False)},
}
LAYERS = {"7b": 28, "0.5b": 24}
L2_MULTIPLE_BYTES = 256 << 20  # rotate weights over copies of at least this much in all


def log(*args):
    print(*args, flush=True)


def sweep_configs(rows: int, silu: bool, wide: bool = False) -> list[SkinnyConfig]:
    """The tiles --sweep times. wide: also many columns a program over a K loop (the loads software-pipelined over
    num_stages), accumulators of 2-8 K floats, 4 or 8 warps."""
    block_m = 1 << (max(rows, 1) - 1).bit_length()
    out = []
    for block_n, block_k, warps in itertools.product((2, 4, 8), (512, 1024, 2048, 4096), (4, 8)):
        if block_m * block_n * block_k * (2 if silu else 1) <= 2048 * warps:
            out.append(SkinnyConfig(block_n, block_k, warps))
    if wide:
        for block_n, elements, warps, stages in itertools.product((2, 4, 8, 16, 32), (2048, 4096, 8192), (4, 8),
                                                                  (2, 4)):
            block_k = elements // block_n
            if 32 <= block_k <= 2048 and block_m * elements * (2 if silu else 1) <= 4096 * warps:
                out.append(SkinnyConfig(block_n, block_k, warps, stages))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--models", default="0.5b,7b")
    parser.add_argument("--sweep", action="store_true", help="time other tiles too")
    parser.add_argument("--sweep-rows", default="1", help="the row counts --sweep times other tiles at")
    parser.add_argument("--sweep-wide", action="store_true", help="--sweep over the wide space too (sweep_configs)")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head", help="which of each model's matmuls")
    parser.add_argument("--calls", type=int, default=24)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows_out, best = [], {}
    for model in args.models.split(","):
        for name, (n, k, fused, has_bias) in SHAPES[model].items():
            if name not in args.shapes.split(","):
                continue
            silu, norm = "silu" in fused, "norm" in fused
            weight_bytes = n * k * 2
            copies = max(1, min(64, -(-L2_MULTIPLE_BYTES // weight_bytes)))
            weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
            bias = torch.randn(n, device=device, dtype=torch.bfloat16) if has_bias else None
            norm_weight = torch.randn(k, device=device, dtype=torch.bfloat16)
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                residual = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                turn = [0]

                def next_weight():
                    turn[0] = (turn[0] + 1) % copies
                    return weights[turn[0]]

                def unfused():
                    h, r = add_rms_norm_triton(x, residual, norm_weight, 1e-6) if norm else (x, None)
                    y = F.linear(h, next_weight(), bias)
                    return (silu_mul_triton(y) if silu else y), r

                def fused_call(config=None):
                    return norm_linear_triton(x, residual if norm else None, norm_weight if norm else None, 1e-6,
                                              next_weight(), bias, config=config, silu_mul=silu)

                turn[0] = -1
                want, want_residual = unfused()
                turn[0] = -1
                got, got_residual = fused_call()
                error = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
                residual_exact = (not norm) or torch.equal(got_residual, want_residual)
                calls = max(args.calls, copies)
                unfused_us = graph_us(unfused, calls)
                fused_us = graph_us(fused_call, calls)
                chosen = skinny_config(rows, n // 2 if silu else n, k, silu, device)
                row = dict(model=model, shape=name, n=n, k=k, rows=rows, fused=fused or "plain",
                           unfused_us=round(unfused_us, 2), fused_us=round(fused_us, 2),
                           speedup=round(unfused_us / fused_us, 3), max_rel_error=round(error, 5),
                           residual_exact=residual_exact, config=vars(chosen))
                if args.sweep and str(rows) in args.sweep_rows.split(","):
                    timed = []
                    for config in sweep_configs(rows, silu, args.sweep_wide):
                        try:
                            timed.append((graph_us(lambda: fused_call(config), calls), config))
                        except Exception as error_:  # a tile the compiler refuses (shared memory, registers)
                            log(f"  {config}: {type(error_).__name__}")
                    timed.sort(key=lambda t: t[0])
                    row["sweep_best"] = [dict(us=round(us, 2), **vars(c)) for us, c in timed[:5]]
                    best[(model, name, rows)] = timed[0]
                log(row)
                rows_out.append(row)
            del weights
            torch.cuda.empty_cache()
    summary = []
    for model in args.models.split(","):
        for rows in [int(r) for r in args.rows.split(",")]:
            cells = {r["shape"]: r for r in rows_out if r["model"] == model and r["rows"] == rows}
            if len(cells) < len(SHAPES[model]):  # --shapes left some out: no layer to add up
                continue
            layer = [cells[s] for s in ("qkv", "o", "gate_up", "down")]
            layer_unfused = sum(c["unfused_us"] for c in layer)
            layer_fused = sum(c["fused_us"] for c in layer)
            swept = (sum(best[(model, c["shape"], rows)][0] for c in layer)
                     if all((model, c["shape"], rows) in best for c in layer) else None)
            summary.append(dict(model=model, rows=rows, layer_unfused_us=round(layer_unfused, 2),
                                layer_fused_us=round(layer_fused, 2), layer_speedup=round(layer_unfused / layer_fused, 3),
                                layer_best_swept_us=round(swept, 2) if swept else None,
                                step_saving_us=round((layer_unfused - layer_fused) * LAYERS[model], 1),
                                lm_head_speedup=cells["lm_head"]["speedup"]))
    if summary:
        print_table(summary, list(summary[0]))
    path = write_results("skinny_linear", rows_out, {"summary": summary, "sweep": args.sweep})
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
