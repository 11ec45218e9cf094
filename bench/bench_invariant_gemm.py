"""The batch-invariant mode's GEMM (kernels/linear_triton.py) across tile shapes and K splits, against cuBLAS, on
the weight shapes of the 7B target and the 0.5B draft (random bf16 weights; no model is built).

For every candidate (tile, and the program slots per SM that gemm_config's split of K fills) and every weight shape:
1. Invariance on the device: 288 random rows at once, then the first m rows for each m of `--rows`, a row alone, and
   the splits side by side and in one program: every row must equal its bits in the 288-row call.
2. Device time per call (CUDA-graph replays, bench_kernels.graph_us) at each m of `--rows`: the splits side by side
   and in one program (where K is split), and cuBLAS (F.linear) beside them.
The summary adds each model's per-layer GEMMs (qkv, o, gate/up, down) and its lm_head for each m, for each candidate,
with the placement `splits_side_by_side` picks and with the faster one, as cuBLAS time / the mode's.

`--variants` instead (or `--row-tiles`, its shorthand for other row tiles): each shape's default config launched
other ways, its K splits kept (row and weight tiles, the MMA's operands swapped, tensor descriptors:
linear_triton.launch_variant), each checked on the device for the default launch's bits at every row count and
placement, then timed beside it and cuBLAS.

Writes $OUT/invariant_gemm.json (else bench/results/). One GPU:
    python3 bench/bench_invariant_gemm.py [--rows 1,5,8,32,40,160,288] [--budget-s 420]
    python3 bench/bench_invariant_gemm.py --rows 1,8,32,160,1024 --variants swap:32:128:4:4,swap-tma:64:128:4:4
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from bench_kernels import graph_us  # noqa: E402
from specsplit.kernels import linear_triton as linear_triton_module  # noqa: E402
from specsplit.kernels.device import sm_count  # noqa: E402
from specsplit.kernels.linear_triton import (Tile, default_tile, gemm_config, launch_variant,  # noqa: E402
                                             linear_triton, splits_side_by_side)

# [N, K] of each model's GEMMs (Qwen2.5 shapes: qkv and gate/up packed as the engine packs them); lm_head last.
SHAPES = {
    "7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944),
           "lm_head": (152064, 3584)},
    "0.5b": {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864),
             "lm_head": (151936, 896)},
}
LAYERS = {"7b": 28, "0.5b": 24}
CANDIDATE_TILES = (
    Tile(64, 64, 64, 4, 4), Tile(64, 64, 128, 4, 3), Tile(16, 64, 128, 4, 4), Tile(32, 64, 128, 4, 4),
    Tile(32, 64, 64, 4, 4), Tile(64, 128, 64, 8, 3), Tile(64, 128, 64, 4, 3), Tile(128, 128, 64, 8, 3),
    Tile(64, 256, 64, 8, 3),
)
# Program slots per SM that gemm_config fills when it splits K (3: the default).
PROGRAMS_PER_SM = (3, 2, 4)


def log(*args):
    print(*args, flush=True)


def tile_name(tile: Tile) -> str:
    return f"{tile.block_m}x{tile.block_n}x{tile.block_k}w{tile.num_warps}s{tile.num_stages}"


def invariant(weight, bias, cfg, rows_list, max_rows) -> bool:
    """Every row of the smaller calls equals its bits in the max_rows call, whichever placement of the splits."""
    x = torch.randn(max_rows, weight.shape[1], device=weight.device, dtype=weight.dtype)
    full = linear_triton(x, weight, bias, config=cfg)
    calls = [(m, placement) for m in rows_list for placement in (None, True, False)]
    for m, placement in calls:
        if not torch.equal(linear_triton(x[:m], weight, bias, config=cfg, side_by_side=placement), full[:m]):
            return False
    return torch.equal(linear_triton(x[7:8], weight, bias, config=cfg)[0], full[7])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,5,8,32,40,160,288")
    parser.add_argument("--models", default="7b,0.5b")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting candidates after this")
    parser.add_argument("--calls", type=int, default=10, help="calls per captured graph")
    parser.add_argument("--row-tiles", default="",
                        help="only the row-tile family: BLOCK_M:warps:stages,... beside the default tile, each "
                             "checked for the default's bits and timed (e.g. 64:4:4,128:4:4,128:8:4,256:8:3); "
                             "shorthand for --variants plain:BLOCK_M:64:warps:stages,...")
    parser.add_argument("--variants", default="",
                        help="only these launch variants of each shape's default config (same K splits): "
                             "[swap|plain][-tma]:BLOCK_M:BLOCK_N:warps:stages,... each checked for the default's "
                             "bits and timed (BLOCK_M: the rows' tile, BLOCK_N: the weight rows' tile)")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    started = time.perf_counter()
    device = torch.device("cuda")
    num_sms = sm_count(device)
    rows_out: list[dict] = []
    meta = {"device": torch.cuda.get_device_name(device), "sms": num_sms, "rows": rows_list,
            "default_tile": tile_name(default_tile(torch.bfloat16))}

    def save():
        write_results("invariant_gemm", rows_out, {**meta, "seconds": time.perf_counter() - started,
                                                   "mma_instructions": mma_instructions()})

    weights = {}
    for model in args.models.split(","):
        for layer, (n, k) in SHAPES[model].items():
            weight = (torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16)
            bias = torch.randn(n, device=device, dtype=torch.bfloat16) if layer == "qkv" else None
            weights[(model, layer)] = (weight, bias)
            for m in rows_list:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                rows_out.append({"section": "cublas", "model": model, "layer": layer, "n": n, "k": k, "rows": m,
                                 "us": graph_us(lambda: F.linear(x, weight, bias), args.calls)})
    save()
    variants = args.variants or ",".join(  # a row tile BLOCK_M:warps:stages is the plain launch with that row tile
        "plain:{}:{}:{}:{}".format(tile.split(":")[0], default_tile(torch.bfloat16).block_n, *tile.split(":")[1:])
        for tile in filter(None, args.row_tiles.split(",")))
    if variants:
        rows_out += launch_variants(weights, variants, rows_list, num_sms, args.calls, started, args.budget_s)
        save()
        return
    for tile in CANDIDATE_TILES:
        for pps in PROGRAMS_PER_SM:
            if time.perf_counter() - started > args.budget_s:
                log(f"budget reached: {tile_name(tile)} {pps} per SM and later not run")
                meta["stopped_early"] = True
                save()
                break
            for (model, layer), (weight, bias) in weights.items():
                n, k = weight.shape
                cfg = gemm_config(n, k, torch.bfloat16, num_sms, tile=tile, programs_per_sm=pps)
                common = {"model": model, "layer": layer, "n": n, "k": k, "tile": tile_name(tile),
                          "programs_per_sm": pps, "split_k": cfg.split_k}
                earlier = [r for r in rows_out if r["section"] == "mode" and r["tile"] == common["tile"]
                           and (r["model"], r["layer"], r["split_k"]) == (model, layer, cfg.split_k)]
                if earlier:  # the same split timed at another slot count: reuse
                    rows_out.extend({**r, "programs_per_sm": pps, "reused": True} for r in earlier
                                    if not r.get("reused"))
                    continue
                try:
                    ok = invariant(weight, bias, cfg, rows_list, max(rows_list))
                except Exception as error:  # a tile that does not compile (shared memory) is a result
                    rows_out.append({"section": "error", **common, "error": repr(error)[:300]})
                    log("error", common, repr(error)[:200])
                    continue
                for m in rows_list:
                    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                    row = {"section": "mode", **common, "rows": m, "invariant": ok,
                           "rule_side_by_side": splits_side_by_side(m, n, cfg, num_sms),
                           "in_program_us": graph_us(lambda: linear_triton(x, weight, bias, config=cfg,
                                                                           side_by_side=False), args.calls)}
                    if cfg.split_k > 1:
                        row["side_by_side_us"] = graph_us(lambda: linear_triton(x, weight, bias, config=cfg,
                                                                                side_by_side=True), args.calls)
                    rows_out.append(row)
                log(tile_name(tile), pps, model, layer, "split", cfg.split_k, "invariant", ok,
                    f"{time.perf_counter() - started:.0f}s")
            save()
        else:
            continue
        break
    summary = summarise(rows_out, rows_list)
    meta["summary"] = summary
    save()
    print_table(summary, ["model", "part", "tile", "programs_per_sm", "invariant"] + [f"chosen_{m}" for m in rows_list])


def mma_instructions() -> dict:
    """For each compiled instance of the GEMM kernel: does its PTX use Hopper's wgmma or the older mma.sync?"""
    found = {}
    for entry in linear_triton_module._linear_kernel.device_caches.values():
        for key, compiled in entry[0].items():
            ptx = compiled.asm.get("ptx", "")
            found[str(key)[-160:]] = {"wgmma": "wgmma" in ptx, "mma_sync": "mma.sync" in ptx}
    return found


def launch_variants(weights, spec: str, rows_list: list[int], num_sms: int, calls: int, started: float,
                    budget_s: float) -> list[dict]:
    """Each shape's default config launched other ways (row and weight tiles, the MMA's operands swapped, tensor
    descriptors): whether each gives every row the default's bits at every row count and placement, and its time
    per call with the placement `splits_side_by_side` picks and with the splits in one program."""
    out = []
    for (model, layer), (weight, bias) in weights.items():
        n, k = weight.shape
        base = gemm_config(n, k, torch.bfloat16, num_sms)
        x = torch.randn(max(rows_list), k, device=weight.device, dtype=torch.bfloat16)
        want = linear_triton(x, weight, bias, config=base, side_by_side=False)
        for item in ["plain:%d:%d:%d:%d" % (base.block_m, base.block_n, base.num_warps, base.num_stages)] + spec.split(","):
            if time.perf_counter() - started > budget_s:
                log("budget reached:", model, layer, item, "and later not run")
                return out
            cfg = launch_variant(item, base)
            try:
                same = all(torch.equal(linear_triton(x[:m], weight, bias, config=cfg, side_by_side=placement),
                                       want[:m]) for m in rows_list for placement in (True, False))
            except Exception as error:  # a tile that does not compile (shared memory) is a result
                out.append({"section": "variant_error", "model": model, "layer": layer, "variant": item,
                            "error": repr(error)[:300]})
                log("error", model, layer, item, repr(error)[:200])
                continue
            for m in rows_list:
                xm = x[:m].contiguous()
                side = splits_side_by_side(m, n, cfg, num_sms)
                out.append({"section": "variant", "model": model, "layer": layer, "n": n, "k": k, "rows": m,
                            "variant": item, "split_k": cfg.split_k, "same_bits_as_default": same,
                            "rule_side_by_side": side,
                            "chosen_us": graph_us(lambda: linear_triton(xm, weight, bias, config=cfg), calls),
                            "in_program_us": graph_us(lambda: linear_triton(xm, weight, bias, config=cfg,
                                                                            side_by_side=False), calls)})
            log(model, layer, item, "same bits", same,
                {m: round(r["chosen_us"], 1) for m, r in zip(rows_list, out[-len(rows_list):])},
                f"{time.perf_counter() - started:.0f}s")
    return out


def summarise(rows: list[dict], rows_list: list[int]) -> list[dict]:
    """Per model, candidate (tile, slots per SM) and m: the layer's four GEMMs and the lm_head, each with the
    placement `splits_side_by_side` picks ("chosen") and with the faster one ("best"), as cuBLAS time / mode time."""
    cublas = {(r["model"], r["layer"], r["rows"]): r["us"] for r in rows if r["section"] == "cublas"}
    mode = {(r["model"], r["layer"], r["tile"], r["programs_per_sm"], r["rows"]): r for r in rows if r["section"] == "mode"}
    out = []
    for model, tile, pps in dict.fromkeys((key[0], key[2], key[3]) for key in mode):
        for part, layers in (("layer", ("qkv", "o", "gate_up", "down")), ("lm_head", ("lm_head",))):
            found = [[mode.get((model, layer, tile, pps, m)) for layer in layers] for m in rows_list]
            if any(r is None for per_m in found for r in per_m):
                continue
            entry = {"model": model, "part": part, "tile": tile, "programs_per_sm": pps,
                     "invariant": all(r["invariant"] for per_m in found for r in per_m)}
            for m, per_m in zip(rows_list, found):
                base = sum(cublas[(model, layer, m)] for layer in layers)
                chosen = sum(r["side_by_side_us"] if r["rule_side_by_side"] else r["in_program_us"] for r in per_m)
                best = sum(min(r["in_program_us"], r.get("side_by_side_us", float("inf"))) for r in per_m)
                entry[f"chosen_{m}"] = round(base / chosen, 3)
                entry[f"best_{m}"] = round(base / best, 3)
            out.append(entry)
    return out


if __name__ == "__main__":
    main()
