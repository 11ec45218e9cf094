"""A matmul of few rows with its neighbours fused in, Triton version of kernels/skinny_linear.py (same contract and
rounding steps).

One kernel per projection, no split of K and so no reduction kernel after it: program p computes output columns
[p * BLOCK_N, (p + 1) * BLOCK_N) of every row, streaming those weight rows along K in [BLOCK_N, BLOCK_K] tiles. The
rows (at most MAX_ROWS) live in registers; the products accumulate elementwise in a [BLOCK_M, BLOCK_N, BLOCK_K]
float32 tile and are summed across K once at the end, so the loop is loads and FMAs only.

- HAS_NORM: the prologue, in the same pass over K: each x tile gets the residual added (rounded as torch's add;
  program 0 writes the sum, the residual stream) and the norm's weight multiplied in, while the row's sum of squares
  accumulates beside the products; the row's scale 1/rms multiplies the finished sums. One pass, so the weight
  streams from the first instruction; the price is rounding: the unfused path rounds the normed row to 16 bits
  twice (after the scale, after the weight) before the matmul, this kernel not at all (it is the more exact of the
  two, and differs from it by those roundings, as two matmul kernels differ by their sum orders).
- SILU_MUL: the epilogue. Each program accumulates its gate columns and the matching up columns (weight rows n and
  n + N) and writes SiLU(gate) * up, with silu_mul's roundings.
- `norm_qkv_rotary_triton` (the fused q/k/v projection): each program accumulates rotary pairs, columns j and
  j + head_dim / 2 of one head, and finishes them as rotary_kv_triton does: q rotated to its output, k rotated and v
  as it is into their cache slots (no qkv tensor is written, and no rotary kernel runs after it).

The tile sizes follow the shape (`skinny_config`): enough programs to spread the weight over the SMs, and an
accumulator tile of about 4096 floats per four warps.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specsplit.kernels.device import sm_count
from specsplit.kernels.rotary_kv_triton import rotate_pairs
from specsplit.kernels.rounding_triton import cast_rtne
from specsplit.kernels.skinny_linear import SKINNY_MAX_ROWS as MAX_ROWS
_ACCUMULATOR_ELEMENTS_PER_WARP = 1024
_PROGRAMS_PER_SM = 2


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3  # Triton's default: the K loop's loads pipelined three deep


def skinny_config(rows: int, n: int, k: int, silu_mul: bool, device: torch.device) -> SkinnyConfig:
    """One row (what runs by default): K in one or few long tiles, four columns a program (two for long rows, to
    spread them over more programs), the fastest or within 2% of it in the H100 sweep for every 0.5B weight
    (bench/bench_skinny_linear.py --sweep). More rows (tests, sweeps): column tiles
    small enough that the programs cover the SMs about twice, K tiles as long as the accumulator's budget allows
    (two accumulators with SiLU * up)."""
    if rows == 1:
        block_k = max(32, min(1024 if silu_mul else 2048, triton.next_power_of_2(k)))
        return SkinnyConfig(2 if k > 2048 else 4, block_k, 4)
    block_m = triton.next_power_of_2(max(rows, 1))
    spread = max(1, n // (_PROGRAMS_PER_SM * sm_count(device)))
    block_n = max(4, min(32, 1 << (spread.bit_length() - 1)))
    num_warps = 4
    budget = _ACCUMULATOR_ELEMENTS_PER_WARP * num_warps // (2 if silu_mul else 1)
    block_k = max(32, min(1024, budget // (block_m * block_n), triton.next_power_of_2(k)))
    return SkinnyConfig(block_n, block_k, num_warps)


@triton.jit
def normed_products(
    x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, w_rows, pair_offset,
    rows, row_mask, col_mask, K, eps, stride_x, stride_r, stride_ro, pid,
    HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """The main loop: float32 sums of the rows (the residual added and the norm applied, if asked) times the weight
    rows w_rows [BLOCK_N, 1] and, PAIRED, times the rows pair_offset elements further on (up's for SiLU * up, the
    rotary partners for q/k). Returns (sums, paired sums) [BLOCK_M, BLOCK_N], bias not added, not rounded. Program
    0 (pid) stores the residual stream (x + residual)."""
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    r_rows = residual_ptr + rows[:, None].to(tl.int64) * stride_r
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PAIRED:
        acc_pair = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if HAS_NORM:
        squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x_mask = row_mask[:, None] & k_mask[None, :]
        x = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
        if HAS_RESIDUAL:  # the residual add rounds to the activations' dtype, as torch's add does
            r = tl.load(r_rows + ks[None, :], mask=x_mask, other=0.0)
            x = cast_rtne(x.to(tl.float32) + r.to(tl.float32), dtype, INTERPRETER)
            out_rows = residual_out_ptr + rows[:, None].to(tl.int64) * stride_ro
            tl.store(out_rows + ks[None, :], x, mask=x_mask & (tl.full([BLOCK_M, BLOCK_K], pid, tl.int32) == 0))
        x32 = x.to(tl.float32)
        if HAS_NORM:  # the row's scale comes after the sum; the norm's weight goes in here
            squares += x32 * x32
            x32 = x32 * tl.load(norm_weight_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        x3 = x32[:, None, :]
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)
        acc += x3 * w.to(tl.float32)[None, :, :]
        if PAIRED:
            w_pair = tl.load(w_rows + pair_offset + ks[None, :], mask=w_mask, other=0.0)
            acc_pair += x3 * w_pair.to(tl.float32)[None, :, :]

    y = tl.sum(acc, axis=2)
    if HAS_NORM:
        rstd = tl.math.rsqrt(tl.sum(squares, axis=1) / K + eps)
        y = y * rstd[:, None]
    y_pair = y
    if PAIRED:
        y_pair = tl.sum(acc_pair, axis=2)
        if HAS_NORM:
            y_pair = y_pair * rstd[:, None]
    return y, y_pair


@triton.jit
def _skinny_linear_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, weight_ptr, bias_ptr, out_ptr,
    M, N, K, eps,
    stride_x, stride_r, stride_ro, stride_w, stride_o,
    HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    w_rows = weight_ptr + cols[:, None].to(tl.int64) * stride_w
    # SiLU * up: each program's gate columns n and the matching up columns n + N
    y, up = normed_products(
        x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, w_rows, N * stride_w,
        rows, row_mask, col_mask, K, eps, stride_x, stride_r, stride_ro, pid,
        HAS_NORM, HAS_RESIDUAL, SILU_MUL, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETER,
    )
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = cast_rtne(y, out_dtype, INTERPRETER)
    if SILU_MUL:
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        up = cast_rtne(up, out_dtype, INTERPRETER)
        gate = y.to(tl.float32)
        activated = cast_rtne(gate / (1.0 + tl.exp(-gate)), out_dtype, INTERPRETER)
        y = cast_rtne(activated.to(tl.float32) * up.to(tl.float32), out_dtype, INTERPRETER)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
    tl.store(out_ptrs, y, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _norm_qkv_rotary_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, weight_ptr, bias_ptr,
    positions_ptr, cos_sin_ptr, slot_ptr, q_out_ptr, key_cache_ptr, value_cache_ptr,
    M, K, eps, num_heads, num_kv_heads,
    stride_x, stride_r, stride_ro, stride_w, stride_qo_t, stride_qo_h,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """Program p: BLOCK_N rotary pairs (columns j and j + HALF) of one head of the fused q/k/v projection. q heads
    leave rotated, k heads go rotated into their cache slots, v heads as they are; rotary_kv_triton's arithmetic."""
    pid = tl.program_id(0)
    head = pid // (HALF // BLOCK_N)
    j = (pid % (HALF // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = head * (2 * HALF) + j
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    w_rows = weight_ptr + cols[:, None].to(tl.int64) * stride_w
    y1, y2 = normed_products(
        x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, w_rows, HALF * stride_w,
        rows, row_mask, cols >= 0, K, eps, stride_x, stride_r, stride_ro, pid,
        True, HAS_RESIDUAL, True, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETER,
    )
    if HAS_BIAS:
        y1 += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        y2 += tl.load(bias_ptr + cols + HALF).to(tl.float32)[None, :]
    # The projection's values as the unfused path stores them, then rotary_kv's steps.
    y1 = cast_rtne(y1, dtype, INTERPRETER).to(tl.float32)
    y2 = cast_rtne(y2, dtype, INTERPRETER).to(tl.float32)
    positions = tl.load(positions_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    angles = cos_sin_ptr + positions[:, None] * (2 * HALF) + j[None, :]
    c = cast_rtne(tl.load(angles, mask=row_mask[:, None], other=0.0), dtype, INTERPRETER).to(tl.float32)
    s = cast_rtne(tl.load(angles + HALF, mask=row_mask[:, None], other=0.0), dtype, INTERPRETER).to(tl.float32)
    store_mask = row_mask[:, None] & (j[None, :] >= 0)
    if head < num_heads:
        o1, o2 = rotate_pairs(y1, y2, c, s, dtype, INTERPRETER)
        q_out = q_out_ptr + rows[:, None].to(tl.int64) * stride_qo_t + head * stride_qo_h + j[None, :]
        tl.store(q_out, o1, mask=store_mask)
        tl.store(q_out + HALF, o2, mask=store_mask)
    else:
        slots = tl.load(slot_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
        slot_mask = store_mask & (slots[:, None] >= 0)
        block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
        cache_dtype: tl.constexpr = key_cache_ptr.dtype.element_ty
        if head < num_heads + num_kv_heads:
            r1, r2 = rotate_pairs(y1, y2, c, s, dtype, INTERPRETER)
            kc = (key_cache_ptr + block[:, None] * stride_kcb + offset[:, None] * stride_kcs
                  + (head - num_heads) * stride_kch + j[None, :])
            tl.store(kc, cast_rtne(r1, cache_dtype, INTERPRETER), mask=slot_mask)
            tl.store(kc + HALF, cast_rtne(r2, cache_dtype, INTERPRETER), mask=slot_mask)
        else:
            vc = (value_cache_ptr + block[:, None] * stride_vcb + offset[:, None] * stride_vcs
                  + (head - num_heads - num_kv_heads) * stride_vch + j[None, :])
            tl.store(vc, cast_rtne(y1, cache_dtype, INTERPRETER), mask=slot_mask)
            tl.store(vc + HALF, cast_rtne(y2, cache_dtype, INTERPRETER), mask=slot_mask)


def _launch(x, residual, norm_weight, eps, weight, bias, silu_mul: bool, config: SkinnyConfig | None):
    rows, k = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {rows}")
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    has_norm = norm_weight is not None
    out_dtype = torch.promote_types(norm_weight.dtype, x.dtype) if has_norm else x.dtype
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    if rows == 0:
        return out, residual_out
    config = config or skinny_config(rows, n, k, silu_mul, x.device)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    _skinny_linear_kernel[(triton.cdiv(n, config.block_n),)](
        x, residual if residual is not None else x, norm_weight if has_norm else x, residual_out, weight,
        bias if bias is not None else weight, out,
        rows, n, k, eps,
        x.stride(0), (residual if residual is not None else x).stride(0), residual_out.stride(0), weight.stride(0),
        out.stride(0),
        HAS_NORM=has_norm, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        INTERPRETER=x.device.type == "cpu", num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, residual_out


def norm_linear_triton(x, residual, norm_weight, eps: float, weight, bias, config: SkinnyConfig | None = None,
                       silu_mul: bool = False):
    return _launch(x, residual, norm_weight, eps, weight, bias, silu_mul, config)


def linear_silu_mul_triton(x, weight, bias, config: SkinnyConfig | None = None):
    return _launch(x, None, None, 0.0, weight, bias, True, config)[0]


def skinny_linear_triton(x, weight, bias, config: SkinnyConfig | None = None):
    return _launch(x, None, None, 0.0, weight, bias, False, config)[0]


def rotary_pairs_per_program(head_dim: int) -> int | None:
    """Rotary pairs a program of the q/k/v kernel computes (two columns each: four a program, as the plain one-row
    kernel's tile), or None where the head does not split into them."""
    half = head_dim // 2
    if head_dim % 2 or half != triton.next_power_of_2(half) or half < 2:
        return None
    return 2


def norm_qkv_rotary_triton(x, residual, norm_weight, eps: float, weight, bias, positions, cos_sin, key_cache,
                           value_cache, slot_mapping, num_heads: int, num_kv_heads: int, head_dim: int,
                           block_k: int | None = None):
    """kernels/skinny_linear.py `norm_qkv_rotary_torch` in one kernel: returns (q rotated [rows, num_heads,
    head_dim], x + residual) and writes k, v into their cache slots."""
    rows, k = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {rows}")
    pairs = rotary_pairs_per_program(head_dim)
    assert pairs is not None, "head_dim must be twice a power of two"
    assert weight.shape[0] == (num_heads + 2 * num_kv_heads) * head_dim and norm_weight.dtype == x.dtype
    # 16-bit only: its rotation rounds every product before adding, so no multiply-add contracts it (float32 would)
    assert x.dtype in (torch.bfloat16, torch.float16), 'the fused q/k/v kernel takes 16-bit activations'
    assert cos_sin.is_contiguous() and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    q = torch.empty(rows, num_heads, head_dim, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    if rows == 0:
        return q, residual_out
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    block_k = block_k or skinny_config(1, weight.shape[0], k, False, x.device).block_k
    half = head_dim // 2
    _norm_qkv_rotary_kernel[((num_heads + 2 * num_kv_heads) * (half // pairs),)](
        x, residual if residual is not None else x, norm_weight, residual_out, weight,
        bias if bias is not None else weight, positions, cos_sin, slot_mapping, q, key_cache, value_cache,
        rows, k, eps, num_heads, num_kv_heads,
        x.stride(0), (residual if residual is not None else x).stride(0), residual_out.stride(0), weight.stride(0),
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, HALF=half, BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=pairs, BLOCK_K=block_k, INTERPRETER=x.device.type == "cpu",
        num_warps=4,
    )
    return q, residual_out
