"""y = x @ weight^T + bias, the batch-invariant mode's GEMM, Triton version of `linear_torch` (same contract; the
two agree to rounding, each is invariant on its own).

What makes a row's result independent of its batch (the number of rows M, the row's position among them):
- Everything that shapes the arithmetic comes from (N, K, dtype) and the device alone (`gemm_config`): the tile
  sizes, hence the MMA instructions and the K order inside them, the warps, and the split of K. cuBLAS picks all of
  these by M (a split-K GEMV for one row, tiled GEMMs for many), which is why a verification's k+1 rows and a
  decode's one row differ in the last bits.
- A row-tile of BLOCK_M rows is computed the same way whichever of its rows are real (rows past M read zeros).
- With SPLIT_K > 1 each split of K is summed from zero into a float32 partial and the partials are added in split
  order 0..SPLIT_K-1 (no atomics), then the bias, then one rounding. Where those additions run is free to follow M
  (`splits_side_by_side`): at few rows program (m, n, s) writes its split's partial and `_reduce_splits_kernel` adds
  them; at many rows each tile's program runs its splits one after another and adds them itself. The same
  additions in the same order: the same bits.

Why split K at all: decode has few rows, so a layer with few column tiles (the 7B's o_proj: 56 tiles of 64 columns
on 132 SMs) would leave most SMs idle while a few stream the whole weight. The split is chosen for one row-tile
(`gemm_config`: the fewest splits whose programs fill their waves of three programs per SM, as many as fit at once)
and then kept for every M. At many rows the row-tiles fill the SMs themselves, and the splits run inside each
program (no partials to write and read back).

Launch variants (experimental, off unless SPECSPLIT_INVARIANT_GEMM_LAUNCH names them; `launch_rule`): the same K
splits and K order launched with other tiles, the MMA's operands swapped (out^T = W x^T: the weight's rows fill the
MMA's M side, at least 64 a warp group, and the rows its N side, as few as 16, where a 160-row verification in
64-row tiles pads to 192), or tiles loaded through tensor descriptors. Whether the device's MMA then adds each
element's products in the same order, i.e. gives the default launch's bits, is measured on the device
(bench/bench_invariant_gemm.py --variants), not assumed; float32 (products added one by one) never takes them.

Fusion points, for later (not implemented): `_load_tile` is where an input prologue goes (RMSNorm of the rows:
scale the x tile by each row's precomputed rstd and the norm weight's K slice), `_finish` where an output epilogue
goes (SiLU(gate) * up: gate and up as two accumulators over weight rows n and n + N/2); each behind a tl.constexpr
flag, so the plain instance compiles unchanged.
"""

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from specsplit.kernels.device import sm_count
from specsplit.kernels.rounding_triton import cast_rtne

# One row-tile should give about this many programs per SM before K is split (16-bit tiles of 64 x 64 x 64 with 4
# stages take 64 KiB of shared memory: 3 programs fit on an H100 SM at once); a split streams at least
# _MIN_K_BLOCKS_PER_SPLIT blocks of K (its partial costs a write and a read of BLOCK_M x BLOCK_N floats).
_PROGRAMS_PER_SM = 3
_MIN_K_BLOCKS_PER_SPLIT = 4
_MAX_SPLIT_K = 16
_GOOD_FILL = 0.9
LAUNCH_ENV = "SPECSPLIT_INVARIANT_GEMM_LAUNCH"


@dataclass(frozen=True)
class Tile:
    """A program's share of the GEMM and how it runs: rows x columns x K per step, warps, pipeline stages."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int  # multiple of block_k; split s covers K columns [s * k_per_split, (s + 1) * k_per_split)
    num_warps: int
    num_stages: int
    swap_ab: bool = False  # the MMA computes out^T = W x^T: the weight's rows fill its M side, the rows its N side
    tma: bool = False  # tiles loaded through tensor descriptors (Hopper's bulk copy engine) instead of pointers


def default_tile(dtype: torch.dtype) -> Tile:
    return Tile(64, 64, 32, 4, 3) if dtype == torch.float32 else Tile(64, 64, 64, 4, 4)


def _split_score(programs: int, num_sms: int, slots: int) -> float:
    """How well `programs` equal programs use the device: below one per SM, the share of slots they take (more is
    better: a small layer's GEMM is latency, not bandwidth); from there, the busy share of their waves' slots (a
    launch of 1.13 waves leaves most of the second wave idle)."""
    if programs < num_sms:
        return programs / slots
    return programs / (triton.cdiv(programs, slots) * slots)


def gemm_config(n: int, k: int, dtype: torch.dtype, num_sms: int, *, tile: Tile | None = None,
                programs_per_sm: int = _PROGRAMS_PER_SM) -> GemmConfig:
    """The GEMM's shape for an [N, K] weight: a function of (N, K, dtype, SM count), never of the row count.
    `tile` and `programs_per_sm` replace the defaults (the sweep, bench/bench_invariant_gemm.py).

    K is split only for layers with fewer column tiles than SMs (a wider layer fills the device by its columns):
    into the fewest splits whose programs fill their waves' slots (`programs_per_sm` per SM) to _GOOD_FILL, else the
    split that fills them best."""
    tile = tile or default_tile(dtype)
    tiles_n = triton.cdiv(n, tile.block_n)
    k_blocks = triton.cdiv(k, tile.block_k)
    split = 1
    if tiles_n < num_sms:
        slots, best_score = programs_per_sm * num_sms, -1.0
        for wanted in range(1, max(1, min(k_blocks // _MIN_K_BLOCKS_PER_SPLIT, _MAX_SPLIT_K)) + 1):
            candidate = triton.cdiv(k_blocks, triton.cdiv(k_blocks, wanted))  # no empty split
            score = _split_score(tiles_n * candidate, num_sms, slots)
            if score > best_score + 1e-9:
                split, best_score = candidate, score
            if score >= _GOOD_FILL:
                break
    blocks_per_split = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, blocks_per_split)  # no empty split
    return GemmConfig(tile.block_m, tile.block_n, tile.block_k, split, blocks_per_split * tile.block_k,
                      tile.num_warps, tile.num_stages)


def _variant_fields(spec: str) -> dict:
    """"[plain|swap][-tma]:BLOCK_M:BLOCK_N:warps:stages" -> the GemmConfig fields it sets (refused if malformed)."""
    kind, *numbers = spec.split(":")
    if kind not in ("plain", "plain-tma", "swap", "swap-tma") or len(numbers) != 4 or not all(
            v.isdigit() for v in numbers):
        raise ValueError(f"a launch variant is [plain|swap][-tma]:BLOCK_M:BLOCK_N:warps:stages, not {spec!r}")
    block_m, block_n, warps, stages = (int(v) for v in numbers)
    return dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                swap_ab=kind.startswith("swap"), tma=kind.endswith("-tma"))


def launch_variant(spec: str, base: GemmConfig) -> GemmConfig:
    """`base` launched another way, its K splits kept: "[plain|swap][-tma]:BLOCK_M:BLOCK_N:warps:stages" (BLOCK_M
    the rows' tile, BLOCK_N the weight rows'; swap: the MMA computes out^T = W x^T; -tma: tensor descriptors).
    For 16-bit weights (config_for_rows applies it to no other): a float32 tile's products are added one by one, in
    an order its shape sets."""
    return replace(base, **_variant_fields(spec))


def launch_rule(value: str | None = None) -> list[tuple[int, str]]:
    """SPECSPLIT_INVARIANT_GEMM_LAUNCH (experimental, off by default; for timing on a GPU): "VARIANT@ROWS,..." =
    calls of at least ROWS rows launch their 16-bit shape's config as VARIANT. -> [(rows, variant)], most rows
    first. Only a variant that bench_invariant_gemm.py --variants found giving the default launch's bits on the
    device keeps the mode's guarantee there: its K order is the same, but the MMA's shape is not."""
    value = os.environ.get(LAUNCH_ENV, "") if value is None else value
    rule = []
    for item in filter(None, value.split(",")):
        variant, _, rows = item.rpartition("@")
        if not rows.isdigit() or not variant:
            raise ValueError(f"{LAUNCH_ENV} is VARIANT@ROWS,..., not {value!r}")
        _variant_fields(variant)  # refused here, not at a model's first call
        rule.append((int(rows), variant))
    return sorted(rule, reverse=True)


def config_for_rows(m: int, cfg: GemmConfig, dtype: torch.dtype, rule: list[tuple[int, str]]) -> GemmConfig:
    """The launch for a call of m rows: the first variant of `rule` whose row count m reaches (16-bit), else cfg."""
    if dtype in (torch.bfloat16, torch.float16):
        for rows, variant in rule:
            if m >= rows:
                return launch_variant(variant, cfg)
    return cfg


def splits_side_by_side(m: int, n: int, cfg: GemmConfig, num_sms: int) -> bool:
    """Whether a split GEMM of m rows runs its K splits in programs of their own (then a reduce) or one after
    another inside each tile's program. The bits are the same either way (the same additions in the same order), so
    this may depend on m: side by side while the tiles alone are fewer than the SMs; from there the partials (m x N
    floats per split, written and read back) cost more than the idle SMs they fill (measured on an H100,
    bench/results/invariant_gemm_h100.json)."""
    return cfg.split_k > 1 and triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) < num_sms


@triton.jit
def _load_tile(src, offs_rows, offs_k, rows, K, row0, k0, TMA: tl.constexpr):
    """A [rows, BLOCK_K] tile at K columns offs_k: through a tensor descriptor (its bounds read zeros past `rows`
    and K) or from `src`, the tile rows' start addresses (rows past `rows` and columns past K masked to zeros)."""
    if TMA:
        return src.load([row0, k0])
    return tl.load(src + offs_k[None, :], mask=(offs_rows[:, None] < rows) & (offs_k[None, :] < K), other=0.0)


@triton.jit
def _store_tile(acc, out_ptr, offs_m, offs_n, M, N, stride_om, SWAP_AB: tl.constexpr):
    """acc ([BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] swapped) into out[offs_m, offs_n]: the swapped tile is
    stored through transposed addresses, not transposed in registers."""
    if SWAP_AB:
        tl.store(out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None], acc,
                 mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))
    else:
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc,
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _finish(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS: tl.constexpr,
            SWAP_AB: tl.constexpr, INTERPRETER: tl.constexpr):
    """Bias in float32, one rounding to the output dtype, store."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        if SWAP_AB:
            acc = acc + bias[:, None]
        else:
            acc = acc + bias[None, :]
    _store_tile(cast_rtne(acc, out_ptr.dtype.element_ty, INTERPRETER), out_ptr, offs_m, offs_n, M, N, stride_om,
                SWAP_AB)


@triton.jit
def _dot_k_range(x_src, w_src, offs_m, offs_n, M, N, K, stride_xm, stride_wn, k_lo, k_hi, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, TMA: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, INTERPRETER: tl.constexpr):
    """The float32 sum over K columns [k_lo, k_hi) of the tile, from zero, BLOCK_K columns at a time in order
    ([BLOCK_M, BLOCK_N]; [BLOCK_N, BLOCK_M] swapped: the same products, added in the same K order)."""
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row0 = tl.program_id(0) * BLOCK_M
    col0 = tl.program_id(1) * BLOCK_N
    if TMA:
        x_rows, w_rows = x_src, w_src
    else:  # each tile row's start address, once
        x_rows = x_src + offs_m[:, None].to(tl.int64) * stride_xm
        w_rows = w_src + offs_n[:, None].to(tl.int64) * stride_wn
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = _load_tile(x_rows, offs_m, offs_k, M, K, row0, k0, TMA)
        b = _load_tile(w_rows, offs_n, offs_k, N, K, col0, k0, TMA)
        if INTERPRETER:  # the interpreter multiplies 16-bit operands as raw bits: give it their fp32 values
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SWAP_AB:
            acc = tl.dot(b, tl.trans(a), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)  # wgmma on an H100 (the sweep checks)
    return acc


# M and the split count stay unspecialised (one compile whatever the batch); the strides and K_PER_SPLIT are
# specialised, so the compiler sees them divisible by 16 and issues vector loads.
@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _linear_kernel(
    x_src, w_src, bias_ptr, out_ptr, partial_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, K_PER_SPLIT, SPLIT_K,
    SPLITS_IN_PROGRAM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRETER: tl.constexpr,
):
    # Row-tiles vary fastest: the programs that read the same weight tile run side by side (it stays in L2).
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLITS_IN_PROGRAM:
        # Every split of K in this program, each summed from zero and added to the total in split order: the very
        # additions `_reduce_splits_kernel` makes, so the bits equal the side-by-side splits'.
        acc = _dot_k_range(x_src, w_src, offs_m, offs_n, M, N, K, stride_xm, stride_wn, 0,
                           tl.minimum(K_PER_SPLIT, K), BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, TMA, DOT_PRECISION,
                           INTERPRETER)
        for split in range(1, SPLIT_K):
            k_lo = split * K_PER_SPLIT
            acc = acc + _dot_k_range(x_src, w_src, offs_m, offs_n, M, N, K, stride_xm, stride_wn, k_lo,
                                     tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, TMA,
                                     DOT_PRECISION, INTERPRETER)
        _finish(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, SWAP_AB, INTERPRETER)
    else:  # this program's split of K into partials [SPLIT_K, M, N] float32, added by `_reduce_splits_kernel`
        split = tl.program_id(2)
        k_lo = split * K_PER_SPLIT
        acc = _dot_k_range(x_src, w_src, offs_m, offs_n, M, N, K, stride_xm, stride_wn, k_lo,
                           tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, TMA, DOT_PRECISION,
                           INTERPRETER)
        _store_tile(acc, partial_ptr + (split * M).to(tl.int64) * N, offs_m, offs_n, M, N, N, SWAP_AB)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _reduce_splits_kernel(partial_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLIT_K,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          INTERPRETER: tl.constexpr):
    """out = partial[0] + partial[1] + ... + partial[SPLIT_K - 1] (+ bias), added in that order."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    index = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    acc = tl.load(partial_ptr + index, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        acc = acc + tl.load(partial_ptr + (s * M).to(tl.int64) * N + index, mask=mask, other=0.0)
    _finish(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, False, INTERPRETER)


@functools.cache
def _launch_rule() -> list[tuple[int, str]]:
    return launch_rule()


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: GemmConfig | None = None, side_by_side: bool | None = None) -> torch.Tensor:
    """Same contract as `linear_torch`. `config` (tests, benchmarks) replaces `gemm_config`'s choice,
    `side_by_side` `splits_side_by_side`'s."""
    *lead, k = x.shape
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    num_sms = sm_count(x.device)
    cfg = config or config_for_rows(m, gemm_config(n, k, weight.dtype, num_sms), weight.dtype, _launch_rule())
    if side_by_side is None:
        side_by_side = splits_side_by_side(m, n, cfg, num_sms)
    side_by_side = side_by_side and cfg.split_k > 1
    interpreter = x.device.type == "cpu"
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    partial = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device) if side_by_side else out
    bias_arg = bias if bias is not None else out  # unused without a bias
    tiles = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    x_src, w_src = rows, weight
    if cfg.tma and all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (rows, weight)):
        from triton.tools.tensor_descriptor import TensorDescriptor  # imported only where asked for (Triton >= 3.4)
        x_src = TensorDescriptor.from_tensor(rows, [cfg.block_m, cfg.block_k])
        w_src = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    _linear_kernel[(*tiles, cfg.split_k if side_by_side else 1)](
        x_src, w_src, bias_arg, out, partial, m, n, k, rows.stride(0), weight.stride(0), out.stride(0),
        cfg.k_per_split, cfg.split_k, SPLITS_IN_PROGRAM=not side_by_side, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWAP_AB=cfg.swap_ab, TMA=x_src is not rows,
        DOT_PRECISION=precision, INTERPRETER=interpreter, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if side_by_side:
        block_m, block_n = 32, 128
        _reduce_splits_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            partial, bias_arg, out, m, n, out.stride(0), cfg.split_k, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, INTERPRETER=interpreter, num_warps=4,
        )
    return out.reshape(*lead, n)
