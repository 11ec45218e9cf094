#!/usr/bin/env python3
"""GPU micro-benchmark of the paged-attention kernel (and the rejection sampler), for an H100.

What it measures, in one run:
  1. device copy bandwidth (a 2 GiB device-to-device copy, bytes read + written), the ceiling to compare against;
  2. correctness of `paged_attention_triton` against the torch reference on each shape class first;
  3. decode (1 query) and verification (k+1 = 5 queries) over batch {1, 4, 16, 64} x context {512, 2k, 8k, 32k}, in
     the Qwen2.5-7B attention layout (28 query heads, 4 KV heads, head_dim 128, bf16, block_size 16): the Triton
     kernel on the paged cache against torch SDPA on the same KV gathered into contiguous tensors (two layouts:
     `enable_gqa`, and queries packed per KV head, which is the kernel's own trick; the faster one is the baseline);
  4. optionally split counts (--sweep) and tile configurations (--sweep-tiles), to choose the defaults;
  5. the rejection sampler at a 152k vocabulary, a profile of where attention time goes, and the compiled kernels'
     registers / shared memory.
Kernel times are device times per call from CUDA-graph replays of back-to-back calls (as the engine runs decode; no
Python launch overhead), warm-up first, rotating over enough KV copies that a replay streams at least 3x the L2 size;
the eager time (triton.testing.do_bench median, L2 flushed before each call) is recorded beside it. Achieved
bandwidth counts KV bytes read + q read + out written, as a share of the measured copy bandwidth.

Writes $OUT/kernels.json when OUT is set, else bench/results/kernels.json; prints a short table last.
Run from the repository root: python3 bench/bench_kernels.py [--sweep]. Works without installing the repo.
"""

import argparse
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

REPO = pathlib.Path(__file__).resolve().parents[1]

# Qwen2.5-7B attention layout.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 28, 4, 128, 16, torch.bfloat16
BATCHES, CONTEXTS, QUERY_LENS = (1, 4, 16, 64), (512, 2048, 8192, 32768), (1, 5)
MODES = {1: "decode", 5: "verify"}


def import_kernels():
    """specsplit.kernels, installed or not: without an install, link this checkout's kernels/ as the package."""
    try:
        import specsplit.kernels.paged_attention_triton  # noqa: F401
    except ImportError:
        shim = pathlib.Path(tempfile.gettempdir()) / "specsplit_bench_shim"
        package = shim / "specsplit"
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").touch()
        link = package / "kernels"
        if not link.exists():
            link.symlink_to(REPO / "kernels", target_is_directory=True)
        sys.path.insert(0, str(shim))
    from specsplit.kernels import paged_attention_triton
    from specsplit.kernels.paged_attention import paged_attention_torch
    return paged_attention_torch, paged_attention_triton


def median_ms(fn, warmup=25, rep=100) -> float:
    """Eager timing: do_bench's median, L2 flushed before each call; includes any host launch gap it cannot hide."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_us(fn, calls: int, replays: int = 10) -> float:
    """Device time per call: `calls` back-to-back calls captured in one CUDA graph (as the engine runs decode),
    replayed `replays` times; the median replay over `calls`. No host launch overhead; callers rotate inputs so
    that the calls of one replay do not find their KV in L2."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def graph_calls(copies: int) -> int:
    """Every KV copy at least once, and at least 16 calls per replay."""
    return copies * max(1, math.ceil(16 / copies))


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    n = 1 << 30
    src = torch.randint(0, 255, (2 * n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * 2 * n / (ms * 1e-3)


def git_commit() -> str:
    if os.environ.get("SPECSPLIT_COMMIT"):
        return os.environ["SPECSPLIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
        return head.stdout.strip() + ("+uncommitted" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class PagedKV:
    """`copies` independent paged KV sets for `batch` sequences of `context` tokens, in one shuffled block pool,
    plus the same KV gathered contiguously ([batch, kv_heads, context, head_dim]) for SDPA."""

    def __init__(self, batch: int, context: int, copies: int, with_contiguous: bool):
        blocks_per_seq = context // BLOCK_SIZE
        num_blocks = copies * batch * blocks_per_seq
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.key_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
        self.value_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
        perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
        self.tables = [perm[c * batch * blocks_per_seq:(c + 1) * batch * blocks_per_seq].view(batch, blocks_per_seq)
                       for c in range(copies)]
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.contiguous = []
        if with_contiguous:
            for table in self.tables:
                k = self.key_cache[table.long()].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
                v = self.value_cache[table.long()].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
                self.contiguous.append((k.contiguous(), v.contiguous()))


def rotation_copies(batch: int, context: int, l2_bytes: int) -> int:
    """KV copies to rotate over so that consecutive calls together stream at least 3x the L2 size."""
    kv = kv_bytes(batch, context)
    return 1 if kv >= 3 * l2_bytes else min(256, math.ceil(3 * l2_bytes / kv))


def kv_bytes(batch: int, context: int) -> int:
    return batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize


def moved_bytes(batch: int, context: int, num_q: int) -> int:
    return kv_bytes(batch, context) + 2 * batch * num_q * NUM_HEADS * HEAD_DIM * DTYPE.itemsize


def make_query(batch: int, num_q: int):
    q = torch.randn(batch * num_q, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    qsl = torch.arange(0, batch * num_q + 1, num_q, dtype=torch.int32, device="cuda")
    return q, qsl


def sdpa_variants(q, batch: int, num_q: int, context: int):
    """SDPA callables over contiguous KV, returning [batch * num_q, heads, head_dim] like the kernel."""
    from torch.nn.attention.bias import causal_lower_right

    group = NUM_HEADS // NUM_KV_HEADS
    scale = HEAD_DIM**-0.5
    q_heads = q.view(batch, num_q, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()  # [B, H, n, D]
    # Packed: the rows of one KV head are (query token, head in group), as in the kernel.
    q_packed = (q.view(batch, num_q, NUM_KV_HEADS, group, HEAD_DIM).permute(0, 2, 1, 3, 4)
                .reshape(batch, NUM_KV_HEADS, num_q * group, HEAD_DIM).contiguous())
    if num_q > 1:
        bias = causal_lower_right(num_q, context)
        token = torch.arange(num_q * group, device="cuda") // group
        packed_mask = torch.arange(context, device="cuda")[None, :] <= (context - num_q + token)[:, None]
    else:
        bias = packed_mask = None

    def gqa(k, v):
        out = F.scaled_dot_product_attention(q_heads, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(batch * num_q, NUM_HEADS, HEAD_DIM)

    def packed(k, v):
        out = F.scaled_dot_product_attention(q_packed, k, v, attn_mask=packed_mask, scale=scale)
        return (out.view(batch, NUM_KV_HEADS, num_q, group, HEAD_DIM).permute(0, 2, 1, 3, 4)
                .reshape(batch * num_q, NUM_HEADS, HEAD_DIM))

    return {"sdpa_gqa": gqa, "sdpa_packed": packed}


def rel_err(got, want) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm())


def check_correctness(reference, kernels, log) -> list[dict]:
    """Each shape class against the torch reference (fp32 on the GPU), on fresh random data."""
    rows = []
    for num_q, batch, context in [(1, 4, 2048), (5, 4, 2048), (1, 1, 32768), (5, 1, 32768), (1, 64, 512)]:
        kv = PagedKV(batch, context, 1, with_contiguous=False)
        q, qsl = make_query(batch, num_q)
        args = (kv.tables[0], kv.seq_lens, qsl, HEAD_DIM**-0.5, num_q, context)
        want = reference(q.float(), kv.key_cache.float(), kv.value_cache.float(), *args)
        out = torch.full_like(q, float("nan"))
        got = kernels.paged_attention_triton(q, kv.key_cache, kv.value_cache, *args, out=out)
        torch.cuda.synchronize()
        row = {"mode": MODES[num_q], "batch": batch, "context": context, "rel_err": rel_err(got, want),
               "unwritten": int(got.isnan().sum())}
        row["ok"] = row["rel_err"] < 1.5e-2 and row["unwritten"] == 0
        rows.append(row)
        log(f"check {row}")
        del kv
    return rows


def bench_attention(kernels, copy_bw, l2_bytes, log, rows: list, save, quick=False) -> list[dict]:
    free = torch.cuda.mem_get_info()[0]
    batches = (1, 16, 64) if quick else BATCHES
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, context in itertools.product(batches, CONTEXTS):
        copies = rotation_copies(batch, context, l2_bytes)
        need = 2 * copies * kv_bytes(batch, context) * 1.3
        if need > free * 0.8:
            log(f"skip batch={batch} context={context}: needs {need / 2**30:.1f} GiB")
            continue
        kv = PagedKV(batch, context, copies, with_contiguous=True)
        calls = graph_calls(copies)
        for num_q in QUERY_LENS:
            q, qsl = make_query(batch, num_q)
            tables = itertools.cycle(kv.tables)
            attn = lambda: kernels.paged_attention_triton(  # noqa: E731
                q, kv.key_cache, kv.value_cache, next(tables), kv.seq_lens, qsl, HEAD_DIM**-0.5, num_q, context)
            row = {"mode": MODES[num_q], "num_queries": num_q, "batch": batch, "context": context,
                   "kv_copies": copies, "graph_calls": calls, "bytes": moved_bytes(batch, context, num_q)}
            block_q, _ = kernels.choose_tiles(num_q, NUM_HEADS // NUM_KV_HEADS)
            row["num_splits"] = kernels.choose_num_splits(batch, NUM_KV_HEADS, math.ceil(num_q / block_q), context,
                                                          num_sms)
            row["triton_us"] = graph_us(attn, calls)
            row["triton_eager_us"] = median_ms(attn) * 1e3
            ours = kernels.paged_attention_triton(q, kv.key_cache, kv.value_cache, kv.tables[0], kv.seq_lens, qsl,
                                                  HEAD_DIM**-0.5, num_q, context)
            for name, fn in sdpa_variants(q, batch, num_q, context).items():
                contiguous = itertools.cycle(kv.contiguous)
                try:
                    row[f"{name}_rel_diff"] = rel_err(fn(*kv.contiguous[0]), ours)
                    row[f"{name}_us"] = graph_us(lambda: fn(*next(contiguous)), calls)
                except Exception as exc:  # a backend refusing this shape: recorded, not fatal
                    row[f"{name}_error"] = str(exc).splitlines()[0][:200]
            sdpa_times = [row[k] for k in ("sdpa_gqa_us", "sdpa_packed_us") if k in row]
            gbps = lambda us: row["bytes"] / (us * 1e-6) / 1e9  # noqa: E731
            row["triton_GBps"] = gbps(row["triton_us"])
            row["triton_pct_of_copy_bw"] = 100 * row["triton_GBps"] * 1e9 / copy_bw
            if sdpa_times:
                row["sdpa_best_us"] = min(sdpa_times)
                row["sdpa_best_GBps"] = gbps(row["sdpa_best_us"])
                row["speedup_vs_sdpa"] = row["sdpa_best_us"] / row["triton_us"]
            rows.append(row)
            save()
            log(f"attn {json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})}")
        del kv
        torch.cuda.empty_cache()
    return rows


def kernel_profile(kernels, log) -> list[dict]:
    """Device time of each kernel (attention, merge) from the profiler, for a few shapes: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for num_q, batch, context in [(1, 1, 32768), (5, 1, 32768), (1, 4, 2048), (5, 16, 512), (1, 16, 32768)]:
        kv = PagedKV(batch, context, 1, with_contiguous=False)
        q, qsl = make_query(batch, num_q)
        fn = lambda: kernels.paged_attention_triton(  # noqa: E731
            q, kv.key_cache, kv.value_cache, kv.tables[0], kv.seq_lens, qsl, HEAD_DIM**-0.5, num_q, context)
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        row = {"mode": MODES[num_q], "batch": batch, "context": context}
        for event in prof.key_averages():
            if "paged_attention" in event.key or "merge_splits" in event.key:
                row[event.key + "_us"] = event.device_time_total / max(event.count, 1)
        rows.append(row)
        log(f"profile {row}")
        del kv
    return rows


def compiled_kernels(kernels) -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of the attention kernels (occupancy)."""
    rows = []
    for fn in (kernels._paged_attention_kernel, kernels._merge_splits_kernel):
        caches = getattr(fn, "device_caches", None) or {}
        for device_cache in caches.values():
            compiled = device_cache[0] if isinstance(device_cache, tuple) else device_cache
            for key, kernel in dict(compiled).items():
                try:
                    rows.append({"kernel": fn.fn.__name__, "n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                                 "shared": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
                                 "num_stages": kernel.metadata.num_stages,
                                 "constexprs": str(getattr(kernel.src, "constants", ""))[:300]})
                except Exception as exc:
                    rows.append({"kernel": fn.fn.__name__, "error": str(exc)[:200]})
    return rows


def sweep(kernels, log, rows: list, save) -> list[dict]:
    """Split counts (graph timing), the defaults' main knob, on the shapes that split."""
    for num_q, batch, context in [(1, 1, 32768), (1, 4, 32768), (1, 16, 32768), (5, 4, 32768), (5, 16, 32768),
                                  (1, 4, 2048), (5, 16, 2048)]:
        copies = rotation_copies(batch, context, torch.cuda.get_device_properties(0).L2_cache_size)
        kv = PagedKV(batch, context, copies, with_contiguous=False)
        q, qsl = make_query(batch, num_q)
        for splits in (1, 2, 4, 8, 16, 32, 64, 128):
            if splits * 256 > context:
                continue
            tables = itertools.cycle(kv.tables)
            us = graph_us(lambda: kernels.paged_attention_triton(
                q, kv.key_cache, kv.value_cache, next(tables), kv.seq_lens, qsl, HEAD_DIM**-0.5, num_q, context,
                num_splits=splits), graph_calls(copies), replays=5)
            row = {"kind": "splits", "mode": MODES[num_q], "batch": batch, "context": context, "num_splits": splits,
                   "programs": batch * NUM_KV_HEADS * splits, "us": us,
                   "GBps": moved_bytes(batch, context, num_q) / (us * 1e-6) / 1e9}
            rows.append(row)
            save()
            log(f"sweep {row}")
        del kv
    return rows


def sweep_tiles(kernels, log, rows: list, save) -> list[dict]:
    """Tile configurations (BLOCK_N, warps, pipeline stages) on split-free and split shapes."""
    configs = [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2), (32, 4, 4)]
    for num_q, batch, context in [(1, 64, 8192), (5, 64, 8192), (1, 1, 32768), (5, 4, 32768)]:
        copies = rotation_copies(batch, context, torch.cuda.get_device_properties(0).L2_cache_size)
        kv = PagedKV(batch, context, copies, with_contiguous=False)
        q, qsl = make_query(batch, num_q)
        for bn, nw, ns in configs:
            row = {"kind": "tiles", "mode": MODES[num_q], "batch": batch, "context": context, "block_n": bn,
                   "num_warps": nw, "num_stages": ns}
            tables = itertools.cycle(kv.tables)
            try:
                row["us"] = graph_us(lambda: kernels.paged_attention_triton(
                    q, kv.key_cache, kv.value_cache, next(tables), kv.seq_lens, qsl, HEAD_DIM**-0.5, num_q, context,
                    block_n=bn, num_warps=nw, num_stages=ns), graph_calls(copies), replays=5)
                row["GBps"] = moved_bytes(batch, context, num_q) / (row["us"] * 1e-6) / 1e9
            except Exception as exc:  # out of shared memory / registers for this config
                row["error"] = str(exc).splitlines()[0][:160]
            rows.append(row)
            save()
            log(f"tiles {row}")
        del kv
    return rows


def bench_rejection(log) -> list[dict]:
    """The rejection sampler at a 152k vocabulary, k = 5, support 32: Triton (one launch) vs the torch reference."""
    from specsplit.kernels.rejection_sampling import rejection_sample_torch
    from specsplit.kernels.rejection_sampling_triton import rejection_sample_triton

    rows = []
    vocab, k, support = 151_936, 5, 32
    for batch in (1, 16, 64):
        p = torch.softmax(torch.randn(batch, k + 1, vocab, device="cuda") * 3, -1)
        q_probs, q_ids = p[:, :k].topk(support, -1)
        q_probs = q_probs / q_probs.sum(-1, keepdim=True)
        draft = q_ids[..., 0].clone()
        num_draft = torch.full((batch,), k, device="cuda")
        accept_u, sample_u = torch.rand(batch, k, device="cuda"), torch.rand(batch, k + 1, device="cuda")
        args = (p, draft, q_ids, q_probs, num_draft, accept_u, sample_u)
        want = rejection_sample_torch(*args)
        got = rejection_sample_triton(*args)
        row = {"batch": batch, "vocab": vocab, "k": k, "support": support,
               "equal": bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])),
               "triton_us": 1e3 * median_ms(lambda: rejection_sample_triton(*args)),
               "torch_us": 1e3 * median_ms(lambda: rejection_sample_torch(*args), warmup=5, rep=30)}
        rows.append(row)
        log(f"rejection {row}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep split counts")
    parser.add_argument("--sweep-tiles", action="store_true", help="also sweep tile configurations (compiles many)")
    parser.add_argument("--quick", action="store_true", help="batches 1, 16, 64 only")
    parser.add_argument("--out", help="JSON path (default: $OUT/kernels.json or bench/results/kernels.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    out_path = pathlib.Path(args.out or (pathlib.Path(os.environ["OUT"]) / "kernels.json" if os.environ.get("OUT")
                                         else REPO / "bench" / "results" / "kernels.json"))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()

    def log(msg):
        print(f"[{time.time() - start:6.1f}s] {msg}", flush=True)

    reference, kernels = import_kernels()
    import triton

    props = torch.cuda.get_device_properties(0)
    result = {
        "device": props.name, "sm_count": props.multi_processor_count, "l2_bytes": props.L2_cache_size,
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "commit": git_commit(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "layout": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                   "block_size": BLOCK_SIZE, "dtype": str(DTYPE)},
        "timing": "CUDA-graph replay of back-to-back calls over rotated KV copies (median per call); "
                  "triton_eager_us: triton.testing.do_bench median, L2 flushed",
    }

    def save():
        out_path.write_text(json.dumps(result, indent=1))

    result["copy_bandwidth_GBps"] = copy_bandwidth() / 1e9
    log(f"copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s (read + write)")
    result["correctness"] = check_correctness(reference, kernels, log)
    save()
    if args.sweep_tiles:
        result["sweep_tiles"] = []
        sweep_tiles(kernels, log, result["sweep_tiles"], save)
    if args.sweep:
        result["sweep"] = []
        sweep(kernels, log, result["sweep"], save)
        save()
    rows = result["attention"] = []
    bench_attention(kernels, result["copy_bandwidth_GBps"] * 1e9, props.L2_cache_size, log, rows, save, args.quick)
    by_shape = {(r["mode"], r["batch"], r["context"]): r for r in rows}
    result["verify_over_decode"] = [
        {"batch": b, "context": c,
         "ratio": by_shape[("verify", b, c)]["triton_us"] / by_shape[("decode", b, c)]["triton_us"]}
        for (mode, b, c) in by_shape if mode == "decode" and ("verify", b, c) in by_shape]
    save()
    result["rejection_sampling"] = bench_rejection(log)
    save()
    result["kernel_profile"] = kernel_profile(kernels, log)
    result["compiled_kernels"] = compiled_kernels(kernels)
    save()

    print(f"\n{props.name}: copy {result['copy_bandwidth_GBps']:.0f} GB/s; correctness "
          f"{'ok' if all(r['ok'] for r in result['correctness']) else 'FAILED'}; wrote {out_path}")
    print(f"{'mode':6} {'batch':>5} {'ctx':>6} {'splits':>6} {'triton us':>10} {'GB/s':>7} {'%copy':>6} "
          f"{'sdpa us':>9} {'speedup':>7} {'ver/dec':>7} {'eager us':>9}")
    ratios = {(r["batch"], r["context"]): r["ratio"] for r in result["verify_over_decode"]}
    for r in rows:
        shape = (r["batch"], r["context"])
        ratio = f"{ratios[shape]:.2f}" if r["mode"] == "verify" and shape in ratios else ""
        print(f"{r['mode']:6} {r['batch']:5d} {r['context']:6d} {r['num_splits']:6d} {r['triton_us']:10.1f} "
              f"{r['triton_GBps']:7.0f} {r['triton_pct_of_copy_bw']:6.1f} {r.get('sdpa_best_us', float('nan')):9.1f} "
              f"{r.get('speedup_vs_sdpa', float('nan')):7.2f} {ratio:>7} {r['triton_eager_us']:9.1f}")


if __name__ == "__main__":
    main()
