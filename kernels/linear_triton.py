"""y = x @ weight^T + bias, the batch-invariant mode's GEMM, Triton version of `linear_torch` (same contract; the
two agree to rounding, each is invariant on its own).

What makes a row's result independent of its batch (the number of rows M, the row's position among them):
- Everything that shapes the arithmetic comes from (N, K, dtype) and the device alone (`gemm_config`): the tile
  sizes, hence the MMA instructions and the K order inside them, the warps, and the split of K. cuBLAS picks all of
  these by M (a split-K GEMV for one row, tiled GEMMs for many), which is why a verification's k+1 rows and a
  decode's one row differ in the last bits.
- A row-tile of BLOCK_M rows is computed the same way whichever of its rows are real (rows past M read zeros).
- With SPLIT_K > 1, program (m, n, s) sums its own K range into a float32 partial, and `_reduce_splits_kernel` adds
  the partials in split order 0..SPLIT_K-1 (no atomics), adds the bias and rounds once. With SPLIT_K = 1 the GEMM
  program does that itself.

Why split K at all: decode has few rows, so a layer with few column tiles (the 7B's o_proj: 56 tiles of 64 columns
on 132 SMs) would leave most SMs idle while a few stream the whole weight. The split is chosen so that one row-tile
gives about three programs per SM (as many as fit at once), and then kept for every M. Its cost grows with M (the
partials are M x N floats per split): prefill in the mode pays it, decode and verification hardly do.

Fusion points, for later (not implemented): `_load_rows` is where an input prologue goes (RMSNorm of the rows:
scale the x tile by each row's precomputed rstd and the norm weight's K slice), `_finish` where an output epilogue
goes (SiLU(gate) * up: gate and up as two accumulators over weight rows n and n + N/2); each behind a tl.constexpr
flag, so the plain instance compiles unchanged.
"""

from dataclasses import dataclass

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


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int  # multiple of block_k; split s covers K columns [s * k_per_split, (s + 1) * k_per_split)
    num_warps: int
    num_stages: int


def gemm_config(n: int, k: int, dtype: torch.dtype, num_sms: int) -> GemmConfig:
    """The GEMM's shape for an [N, K] weight: a function of (N, K, dtype, SM count), never of the row count."""
    if dtype == torch.float32:
        block_m, block_n, block_k, warps, stages = 64, 64, 32, 4, 3
    else:
        block_m, block_n, block_k, warps, stages = 64, 64, 64, 4, 4
    tiles_n = triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    split = 1
    if tiles_n < num_sms:
        split = max(1, min(triton.cdiv(_PROGRAMS_PER_SM * num_sms, tiles_n), k_blocks // _MIN_K_BLOCKS_PER_SPLIT,
                           _MAX_SPLIT_K))
    blocks_per_split = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, blocks_per_split)  # no empty split
    return GemmConfig(block_m, block_n, block_k, split, blocks_per_split * block_k, warps, stages)


@triton.jit
def _load_rows(x_ptr, offs_m, offs_k, M, K, stride_xm):
    """The [BLOCK_M, BLOCK_K] input tile; rows past M and columns past K read as zeros."""
    return tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                   mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)


@triton.jit
def _finish(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS: tl.constexpr,
            INTERPRETER: tl.constexpr):
    """Bias in float32, one rounding to the output dtype, store."""
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out = cast_rtne(acc, out_ptr.dtype.element_ty, INTERPRETER)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], out,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om"])
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRETER: tl.constexpr,
):
    # Row-tiles vary fastest: the programs that read the same weight tile run side by side (it stays in L2).
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = split * K_PER_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = _load_rows(x_ptr, offs_m, offs_k, M, K, stride_xm)
        b = tl.load(w_rows + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
        if INTERPRETER:  # the interpreter multiplies 16-bit operands as raw bits: give it their fp32 values
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
    if SPLIT_K == 1:
        _finish(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, INTERPRETER)
    else:  # partials [SPLIT_K, M, N] float32
        part = partial_ptr + (split * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(part, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M", "stride_om"])
def _reduce_splits_kernel(partial_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          INTERPRETER: tl.constexpr):
    """out = partial[0] + partial[1] + ... + partial[SPLIT_K - 1] (+ bias), added in that order."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    index = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    acc = tl.load(partial_ptr + index, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc = acc + tl.load(partial_ptr + (s * M).to(tl.int64) * N + index, mask=mask, other=0.0)
    _finish(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, INTERPRETER)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: GemmConfig | None = None) -> torch.Tensor:
    """Same contract as `linear_torch`. `config` (tests, benchmarks) replaces `gemm_config`'s choice."""
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
    cfg = config or gemm_config(n, k, weight.dtype, sm_count(x.device))
    interpreter = x.device.type == "cpu"
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    partial = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device) if cfg.split_k > 1 else out
    bias_arg = bias if bias is not None else out  # unused without a bias
    tiles = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _linear_kernel[(*tiles, cfg.split_k)](
        rows, weight, bias_arg, out, partial, m, n, k, rows.stride(0), weight.stride(0), out.stride(0),
        K_PER_SPLIT=cfg.k_per_split, SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=precision,
        INTERPRETER=interpreter, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.split_k > 1:
        block_m, block_n = 32, 128
        _reduce_splits_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            partial, bias_arg, out, m, n, out.stride(0), SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, INTERPRETER=interpreter, num_warps=4,
        )
    return out.reshape(*lead, n)
