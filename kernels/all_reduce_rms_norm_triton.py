"""All-reduce + residual add + RMSNorm in one launch over peer-mapped (symmetric) memory, Triton version of
`all_reduce_add_rms_norm_torch` (same contract and rounding steps).

Every rank holds a buffer that every other rank can read over NVLink peer-to-peer (torch's symmetric memory,
CUDA backend: no multicast), in two slots. A call:

1. copies this rank's partial rows into its buffer's slot;
2. meets the other ranks at a barrier (program p of every rank signals program p of every other rank through the
   signal pads: a release compare-and-swap 0 -> 1 on the peer's flag, then an acquire compare-and-swap 1 -> 0 on
   its own; a flag is back at 0 when a barrier is over, so the next call starts clean);
3. reads every rank's row from its slot, sums them in rank order (rounded to the dtype after each add, like the
   one-shot all-reduce), adds the residual and normalises (as kernels/rms_norm_triton.py), and writes the normed
   row and the new residual.

No barrier at the end: calls alternate between the two slots (the caller passes which), so a rank writes a slot
again only two calls later, and the barrier of the call between proves every peer finished reading it. Each
program handles rows pid, pid + programs, ...; the programs of all ranks pair up by number, so the grid must be the
same on every rank (it is: same rows). Offsets are int32: callers keep a call under 2**31 elements (symmetric
buffers are far smaller). Graph-capturable (no host reads); ranks must call it in the same order, as
every collective.

Flags are int32 at pad + (program * world_size + sender) * 4: program counts are capped (MAX_PROGRAMS) so that
they fit any signal pad. Slots are 16-byte aligned (and rows when `hidden` is a multiple of 8), which the kernel
tells the compiler so that it reads peers' rows in 16-byte vectors.
"""

import torch
import triton
import triton.language as tl

from specsplit.kernels.rounding_triton import cast_rtne

MAX_PROGRAMS = 16


@triton.jit
def _exchange_flag(flag, expected, new, SEM: tl.constexpr, MAX_SPINS: tl.constexpr):
    """Compare-and-swap `flag` from `expected` to `new` (system scope), retrying until it succeeds; MAX_SPINS > 0
    gives up after that many tries."""
    if MAX_SPINS == 0:
        while tl.atomic_cas(flag, expected, new, sem=SEM, scope="sys") != expected:
            pass
    else:
        spins = tl.full([], 0, tl.int32)
        while (tl.atomic_cas(flag, expected, new, sem=SEM, scope="sys") != expected) & (spins < MAX_SPINS):
            spins += 1


@triton.jit
def _barrier(pad_ptrs, pid, RANK: tl.constexpr, WORLD: tl.constexpr, MAX_SPINS: tl.constexpr):
    """Program `pid` of every rank meets program `pid` of every other rank. MAX_SPINS > 0 gives up after that many
    tries per flag (a setup check that must not hang a GPU whose peers never come); 0 waits as long as it takes."""
    tl.debug_barrier()  # this program's stores to its slot come before its signals
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_pad = tl.load(pad_ptrs + peer).to(tl.pointer_type(tl.int32))
            _exchange_flag(peer_pad + pid * WORLD + RANK, 0, 1, "release", MAX_SPINS)
    own_pad = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _exchange_flag(own_pad + pid * WORLD + peer, 1, 0, "acquire", MAX_SPINS)
    tl.debug_barrier()


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, slot_ptrs, pad_ptrs,
    rows, hidden, eps, stride_x, stride_r, stride_o, stride_ro,
    RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    MAX_SPINS: tl.constexpr, INTERPRETER: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty
    own_slot = tl.multiple_of(tl.load(slot_ptrs + RANK).to(tl.pointer_type(dtype)), 16)  # vector loads and stores
    for row in range(pid, rows, programs):
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        tl.store(own_slot + row * hidden + cols, x, mask=mask)
    _barrier(pad_ptrs, pid, RANK, WORLD, MAX_SPINS)
    for row in range(pid, rows, programs):
        offset = row * hidden
        first = tl.multiple_of(tl.load(slot_ptrs).to(tl.pointer_type(dtype)), 16)
        x = tl.load(first + offset + cols, mask=mask, other=0.0, cache_modifier=".cg")
        for peer in tl.static_range(1, WORLD):
            peer_slot = tl.multiple_of(tl.load(slot_ptrs + peer).to(tl.pointer_type(dtype)), 16)
            partial = tl.load(peer_slot + offset + cols, mask=mask, other=0.0, cache_modifier=".cg")
            x = cast_rtne(x.to(tl.float32) + partial.to(tl.float32), dtype, INTERPRETER)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = cast_rtne(x.to(tl.float32) + r.to(tl.float32), dtype, INTERPRETER)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        variance = tl.sum(x32 * x32, axis=0) / hidden
        normed = cast_rtne(x32 * tl.math.rsqrt(variance + eps), dtype, INTERPRETER)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        out = cast_rtne(w.to(tl.float32) * normed.to(tl.float32), out_ptr.dtype.element_ty, INTERPRETER)
        tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def all_reduce_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    slot_ptrs: torch.Tensor, pad_ptrs: torch.Tensor, rank: int, world_size: int, max_spins: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: this rank's partial rows [tokens, hidden]. slot_ptrs [world_size] int64 (on x's device): the address of
    every rank's buffer slot for this call, each holding at least tokens * hidden elements of x's dtype;
    pad_ptrs [world_size] int64: every rank's signal pad (zeroed, at least MAX_PROGRAMS * world_size int32).
    `max_spins` > 0: a barrier that waits longer gives up (the results are then wrong: checks only)."""
    tokens, hidden = x.shape
    out = torch.empty(tokens, hidden, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = torch.empty_like(x)
    if tokens:
        block = triton.next_power_of_2(hidden)
        _all_reduce_add_rms_norm_kernel[(min(tokens, MAX_PROGRAMS),)](
            x, residual if residual is not None else x, weight, out, residual_out, slot_ptrs, pad_ptrs,
            tokens, hidden, eps, x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0),
            residual_out.stride(0),
            RANK=rank, WORLD=world_size, HAS_RESIDUAL=residual is not None, BLOCK=block, MAX_SPINS=max_spins,
            INTERPRETER=x.device.type == "cpu", num_warps=4 if block <= 2048 else 8,
        )
    return out, residual_out
