"""Attention over a paged KV cache for variable-length queries, Triton version of `paged_attention_torch`.

Same function, layouts and semantics as the reference (see kernels/paged_attention.py): varlen queries that sit at
the end of their context, causal, GQA, any mix of prefill chunks, decode, catch-up and verification in one call.

How the work is cut:
- GQA packing. A program owns one KV head and a tile of BLOCK_M rows = BLOCK_Q query tokens x GROUP_PAD query
  heads (the heads that read this KV head, padded to a power of two). Every KV tile it loads is used by all those
  rows at once, so decode (1 token x 7 heads) and verification (5 tokens x 7 heads) read the KV exactly once per
  KV head and differ only in arithmetic, which a memory-bound kernel has to spare.
- Online softmax in fp32, in the exp2 domain. KV tiles wholly below the tile's first query position need no causal
  mask and run a mask-free loop; only the last tiles of the context run the masked one.
- Split-KV (flash-decoding). When (sequences x KV heads x query tiles) would not fill the GPU, the context of each
  sequence is cut into num_splits contiguous chunks, one program each; each writes its normalised partial output
  and log-sum-exp, and a second kernel merges them. The split count is chosen on the host from host ints
  (num_seqs, max_query_len, max_seq_len): no device sync.

Batch-invariant mode (`ordered=True`, kernels/dispatch.py): the choices above follow the batch (tile rows by
the longest query, split count by the grid's size), so a decode row, the same row in a k+1 verification and in a
prefill chunk add their KV in different orders. In the mode every call uses one tile shape (BLOCK_M = 64 rows: 8
query tokens of a group of up to 8 heads, BLOCK_N = 64 keys) and a fixed split SIZE along the context
(INVARIANT_SPLIT_TOKENS, whole BLOCK_N tiles from position 0): a row's KV tiles, splits and merge are then fixed by
its position alone, and every tile runs the masked loop (where the first query of a tile sits does not choose the
code a row's tile runs). Splits past a row's position contribute exact zeros (a fully masked tile leaves the running
max, sum and accumulator as they were), and the merge adds the splits one after another in split order, so the
number of empty splits after them (set by the batch's longest context) changes nothing.
"""


import torch
import triton
import triton.language as tl

from specsplit.kernels.device import sm_count
from specsplit.kernels.rounding_triton import cast_rtne

_LOG2E = 1.4426950408889634
# Each split should still stream a useful stretch of KV, or the merge costs more than the parallelism gains.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 128
# One wave of the decode/verification kernels is 2 programs per SM: measured on an H100 and an H200 (split-count
# sweep in bench/bench_kernels.py --sweep: 256 programs beat 320 or 512 on 132 SMs).
_PROGRAMS_PER_SM = 2
# The batch-invariant mode's split size along the context (a multiple of every BLOCK_N): short contexts run
# unsplit as in the default mode; a 4k context uses 16 splits at any batch size. The grid has cdiv(max_seq_len, 256)
# splits, and under CUDA graphs max_seq_len is the graph's context class (up to max_model_len): the programs past a
# tile's context return at once, writing nothing, and the merge stops at each token's own last split.
INVARIANT_SPLIT_TOKENS = 256
INVARIANT_BLOCK_M = 64


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, k_base, v_base, table_row_ptr, kv_offs_n, dims,
    q_pos, kv_end, lo, hi,
    stride_kb, stride_ks, stride_vb, stride_vs,
    qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, D_MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """Online-softmax accumulation of KV positions [lo, hi) into (acc, m_i, l_i)."""
    v_dtype = v_base.dtype.element_ty
    for start in range(lo, hi, BLOCK_N):
        kv_pos = start + kv_offs_n
        if MASKED:
            kv_valid = kv_pos < kv_end
            page = tl.load(table_row_ptr + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
        else:
            page = tl.load(table_row_ptr + kv_pos // BLOCK_SIZE).to(tl.int64)
        in_page = (kv_pos % BLOCK_SIZE).to(tl.int64)
        k_ptrs = k_base + page[:, None] * stride_kb + in_page[:, None] * stride_ks + dims[None, :]
        v_ptrs = v_base + page[:, None] * stride_vb + in_page[:, None] * stride_vs + dims[None, :]
        if MASKED:
            load_mask = kv_valid[:, None]
            if D_MASKED:
                load_mask = load_mask & (dims[None, :] < HEAD_DIM)
            k = tl.load(k_ptrs, mask=load_mask, other=0.0)
            v = tl.load(v_ptrs, mask=load_mask, other=0.0)
        elif D_MASKED:
            k = tl.load(k_ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0)
            v = tl.load(v_ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if INTERPRETER:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            allowed = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # p in the cache dtype for the tensor cores (in the interpreter: its value, kept in fp32 operands).
        p = cast_rtne(p, v_dtype, INTERPRETER).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_q_tiles", "num_kv_heads", "num_heads", "num_splits", "qk_scale"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    num_q_tiles, num_kv_heads, num_heads, num_splits, qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT_KV: tl.constexpr, FIXED_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETER: tl.constexpr,
):
    seq = tl.program_id(0) // num_q_tiles
    q_tile = tl.program_id(0) % num_q_tiles
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_tile_start = q_tile * BLOCK_Q
    if q_tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - q_len  # absolute position of this sequence's first query

    # Rows: query token (row // GROUP_PAD) of the tile x query head (row % GROUP_PAD) of this KV head's group.
    rows = tl.arange(0, BLOCK_M)
    row_token = q_tile_start + rows // GROUP_PAD
    row_head_in_group = rows % GROUP_PAD
    row_valid = (row_token < q_len) & (row_head_in_group < GROUP)
    row_head = kv_head * GROUP + row_head_in_group
    q_pos = context_start + row_token
    dims = tl.arange(0, BLOCK_D)
    D_MASKED: tl.constexpr = BLOCK_D != HEAD_DIM
    dim_valid = dims < HEAD_DIM

    token_index = (q_begin + row_token).to(tl.int64)
    q_ptrs = q_ptr + token_index[:, None] * stride_qt + row_head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if INTERPRETER:
        q = q.to(tl.float32)

    # KV this tile can see: up to its last query's position; this split's share of it, in whole BLOCK_N tiles.
    last_token = tl.minimum(q_tile_start + BLOCK_Q, q_len) - 1
    kv_end = context_start + last_token + 1
    if SPLIT_KV:
        if FIXED_SPLIT > 0:  # batch-invariant: split s is always positions [s * FIXED_SPLIT, (s + 1) * FIXED_SPLIT)
            chunk = FIXED_SPLIT
        else:
            chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        split_lo = tl.minimum(split * chunk, kv_end)
        split_hi = tl.minimum(split_lo + chunk, kv_end)
        if FIXED_SPLIT > 0:
            if split_lo >= kv_end:  # past the tile's context (the count follows the batch's longest): write nothing
                return
    else:
        split_lo = 0
        split_hi = kv_end
    # Below the first query's position every row sees every key: no causal mask needed there.
    first_q_pos = context_start + q_tile_start
    unmasked_hi = tl.minimum(split_hi, ((first_q_pos + 1) // BLOCK_N) * BLOCK_N)
    unmasked_hi = tl.maximum(unmasked_hi, split_lo)
    if FIXED_SPLIT > 0:  # batch-invariant: every tile through the one masked loop, whoever shares the query tile
        unmasked_hi = tl.minimum(unmasked_hi, split_lo)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # A finite floor keeps fully masked rows (in a split before their position) free of inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    kv_offs_n = tl.arange(0, BLOCK_N)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_base, v_base, table_row_ptr, kv_offs_n, dims, q_pos, kv_end, split_lo, unmasked_hi,
        stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
        BLOCK_SIZE, BLOCK_N, False, D_MASKED, HEAD_DIM, DOT_PRECISION, INTERPRETER,
    )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_base, v_base, table_row_ptr, kv_offs_n, dims, q_pos, kv_end, unmasked_hi, split_hi,
        stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
        BLOCK_SIZE, BLOCK_N, True, D_MASKED, HEAD_DIM, DOT_PRECISION, INTERPRETER,
    )

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if not SPLIT_KV:
        o_ptrs = out_ptr + token_index[:, None] * stride_ot + row_head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, cast_rtne(out, out_ptr.dtype.element_ty, INTERPRETER), mask=store_mask)
    else:
        # Partials: [num_tokens, num_heads, num_splits, BLOCK_D] fp32 and lse [num_tokens, num_heads, num_splits].
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        part_row = (token_index * num_heads + row_head) * num_splits + split
        tl.store(part_lse_ptr + part_row, lse, mask=row_valid)
        tl.store(part_out_ptr + part_row[:, None] * BLOCK_D + dims[None, :], out, mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_heads, num_splits,
    SPLITS_PAD: tl.constexpr, SPLIT_TILE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, ORDERED: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """out[t, h] = sum_s exp2(lse_s - max lse) out_s / sum_s exp2(lse_s - max lse), for BLOCK_H heads of token t.
    ORDERED (batch-invariant): both sums split by split, in split order, up to the token's last used split; empty
    splits (lse -inf: past the token's position, or never written, part_lse being filled with -inf) skipped."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    base = (token * num_heads + heads) * num_splits  # [BLOCK_H]
    splits = tl.arange(0, SPLITS_PAD)
    lse = tl.load(part_lse_ptr + base[:, None] + splits[None, :],
                  mask=head_valid[:, None] & (splits[None, :] < num_splits), other=float("-inf"))
    lse_max = tl.max(lse, axis=1)
    lse_max = tl.where(head_valid, lse_max, 0.0)
    dims = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if ORDERED:
        weight_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        # The splits this token uses are a prefix: its position's, whatever the batch's longest context made num_splits.
        used_splits = tl.max(tl.max(tl.where(lse > float("-inf"), splits[None, :] + 1, 0), axis=1), axis=0)
        for split in range(0, used_splits):
            split_lse = tl.load(part_lse_ptr + base + split, mask=head_valid, other=float("-inf"))
            used = split_lse > float("-inf")
            weight = tl.exp2(split_lse - lse_max)
            part = tl.load(part_out_ptr + (base + split)[:, None] * BLOCK_D + dims[None, :],
                           mask=used[:, None], other=0.0)
            acc = tl.where(used[:, None], acc + part * weight[:, None], acc)
            weight_sum = tl.where(used, weight_sum + weight, weight_sum)
        weight_sum = tl.where(used_splits > 0, weight_sum, 1.0)  # a padding token no sequence owns: zeros, not 0/0
    else:
        weight_sum = tl.sum(tl.exp2(lse - lse_max[:, None]), axis=1)
        for first in range(0, num_splits, SPLIT_TILE):
            tile = first + tl.arange(0, SPLIT_TILE)
            tile_valid = head_valid[:, None] & (tile[None, :] < num_splits)  # [BLOCK_H, SPLIT_TILE]
            rows = base[:, None] + tile[None, :]
            weights = tl.exp2(tl.load(part_lse_ptr + rows, mask=tile_valid, other=float("-inf")) - lse_max[:, None])
            parts = tl.load(part_out_ptr + rows[:, :, None] * BLOCK_D + dims[None, None, :],
                            mask=tile_valid[:, :, None], other=0.0)
            acc += tl.sum(parts * weights[:, :, None], axis=1)
    out = acc / tl.where(head_valid, weight_sum, 1.0)[:, None]
    out_mask = head_valid[:, None] & (dims[None, :] < HEAD_DIM)
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             cast_rtne(out, out_ptr.dtype.element_ty, INTERPRETER), mask=out_mask)


def choose_tiles(max_query_len: int, group: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): as many query tokens per tile as fit next to the whole head group."""
    group_pad = triton.next_power_of_2(group)
    rows_cap = 64 if max_query_len <= 16 else 128
    rows = min(max(16, triton.next_power_of_2(max(max_query_len, 1)) * group_pad), max(rows_cap, group_pad))
    return max(rows // group_pad, 1), rows


def choose_num_splits(num_seqs: int, num_kv_heads: int, num_q_tiles: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per (sequence, KV head, query tile). A grid that already gives every SM a program runs unsplit; a
    smaller one is split into as many programs as fit in ONE wave (_PROGRAMS_PER_SM per SM): rounding up instead
    would start a second, mostly idle wave and nearly double the time. A split never streams fewer than
    _MIN_TOKENS_PER_SPLIT positions."""
    programs = num_seqs * num_kv_heads * num_q_tiles
    if programs >= num_sms:
        return 1
    wanted = (_PROGRAMS_PER_SM * num_sms) // max(programs, 1)
    most = max(max_seq_len // _MIN_TOKENS_PER_SPLIT, 1)
    return max(1, min(wanted, most, _MAX_SPLITS))


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    ordered: bool = False,
    split_tokens: int = INVARIANT_SPLIT_TOKENS,
) -> torch.Tensor:
    """Same contract as `paged_attention_torch`. Keyword-only knobs for tests and benchmarks: force the split
    count or tile shape, or pass `out` ([num_tokens, num_heads, head_dim], query's dtype) to write into.
    `ordered` (the batch-invariant mode): its fixed tiles and split size (the knobs must then be left unset);
    `split_tokens`, its split size (tests use smaller ones to reach several splits with short contexts)."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1 and query.stride(2) == 1 and out.stride(2) == 1

    fixed_split = 0
    if ordered:
        assert num_splits is None and block_n is None and num_warps is None, "the mode fixes the kernel's shape"
        assert split_tokens % 64 == 0, "a split is whole KV tiles"
        group_pad = triton.next_power_of_2(group)
        block_m = max(INVARIANT_BLOCK_M, group_pad)
        block_q = block_m // group_pad
        fixed_split = split_tokens
        num_splits = triton.cdiv(max(max_seq_len, 1), fixed_split)
    else:
        block_q, block_m = choose_tiles(max_query_len, group)
    num_q_tiles = triton.cdiv(max(max_query_len, 1), block_q)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, num_q_tiles, max_seq_len, sm_count(query.device))
    block_d = triton.next_power_of_2(head_dim)
    if block_n is None:
        block_n = 64 if block_m <= 64 and query.dtype != torch.float32 else 32
    if num_warps is None:
        num_warps = 4 if block_m <= 64 else 8
    if num_stages is None:
        num_stages = 3
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    # Triton's interpreter (CPU tensors) multiplies bf16 operands as their raw uint16 bits: give it fp32 operands,
    # which is the same arithmetic as a bf16/fp16 tensor-core dot (exact products, fp32 accumulation).
    interpreter = query.device.type == "cpu"

    if num_splits > 1:
        part_out = torch.empty(num_tokens, num_heads, num_splits, block_d, dtype=torch.float32, device=query.device)
        lse_shape = (num_tokens, num_heads, num_splits)
        if ordered:  # the mode's kernel writes nothing for splits past a tile's context: -inf marks them unused
            part_lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=query.device)
        else:
            part_lse = torch.empty(lse_shape, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused

    grid = (num_seqs * num_q_tiles, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        out, part_out, part_lse,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        num_q_tiles, num_kv_heads, num_heads, num_splits, scale * _LOG2E,
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=block_d, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        SPLIT_KV=num_splits > 1, FIXED_SPLIT=fixed_split, DOT_PRECISION=precision, INTERPRETER=interpreter,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        splits_pad = triton.next_power_of_2(num_splits)
        # On a GPU: one head per program, all its splits (up to 128) in one tile, so every load is in flight at once;
        # the merge is latency-bound (4.3 us for 66 splits on an H100). In the CPU interpreter, whose cost is per
        # program: all heads at once, in tiles of 16 splits.
        on_gpu = query.device.type == "cuda"
        block_h = 1 if on_gpu else triton.next_power_of_2(num_heads)
        _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
            SPLITS_PAD=splits_pad, SPLIT_TILE=min(splits_pad, 128 if on_gpu else 16), BLOCK_H=block_h,
            BLOCK_D=block_d, HEAD_DIM=head_dim, ORDERED=ordered, INTERPRETER=interpreter,
            num_warps=8 if splits_pad >= 64 else 4,
        )
    return out
