"""Lossless speculative verification with a sparse draft distribution, Triton version of `rejection_sample_torch`.

Same terms, shapes and outputs as the reference (see kernels/rejection_sampling.py): accepted tokens, then one
recovered token (sampled from norm(max(p - q, 0)) at the first rejection) or one bonus token (sampled from p after
the last draft position). One program per sequence, one launch for the batch, no host sync at all (shapes are fixed
by the padded layout, so the launch can be captured in a CUDA graph).

Inverse-CDF sampling over the vocabulary, as the reference does it: the first index whose cumulative mass reaches
u * total, with the mass accumulated in float64. Two streaming passes over the row, in BLOCK_V blocks:
  1. the total mass (and a count of positive entries, to detect an empty residual exactly, without round-off);
  2. block masses again, in the same order and with the same arithmetic, until the running sum reaches u * total;
then the first crossing index inside that block, by a float64 cumulative sum over SUB_V sub-blocks.
The residual max(p - q, 0) differs from p only on q's support (K ids), so a block's residual mass is its p mass minus
the support's (p - residual) terms inside it, and the dense residual is built only in the crossing block.

Agreement with the reference: token-for-token whenever no cumulative sum lies within float64 round-off (~1e-16
relative) of the threshold; sums taken in another order (a tree here, a sequential scan in torch on the CPU, another
scan in torch on CUDA) can only disagree on such a tie.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _block_mass(p_row_ptr, start, vocab, sup_ids, sup_delta, HAS_SUPPORT: tl.constexpr, BLOCK_V: tl.constexpr):
    """(p mass of the block, support correction inside it, number of positive p entries), masses in float64."""
    offs = start + tl.arange(0, BLOCK_V)
    p = tl.load(p_row_ptr + offs, mask=offs < vocab, other=0.0)
    mass = tl.sum(p.to(tl.float64), axis=0)
    positive = tl.sum((p > 0.0).to(tl.int32), axis=0)
    if HAS_SUPPORT:
        in_block = (sup_ids >= start) & (sup_ids < start + BLOCK_V)
        correction = tl.sum(tl.where(in_block, sup_delta, 0.0), axis=0)
    else:
        correction = tl.zeros([], dtype=tl.float64)
    return mass, correction, positive


@triton.jit
def _sample_row(
    p_row_ptr, vocab, u, sup_ids, sup_res, sup_valid, sup_delta, sup_residual_positive, sup_p_positive,
    HAS_SUPPORT: tl.constexpr, BLOCK_V: tl.constexpr, SUB_V: tl.constexpr,
):
    """Inverse-CDF sample from the row p (HAS_SUPPORT=False) or from max(p - q, 0) on q's support (falling back to p
    when that residual has no mass, as the reference does). Returns an int32 index."""
    # Pass 1: total masses of p and of the residual, accumulated in block order.
    total_plain = tl.zeros([], dtype=tl.float64)
    total_residual = tl.zeros([], dtype=tl.float64)
    num_positive = tl.zeros([], dtype=tl.int32)
    for block_start in range(0, vocab, BLOCK_V):
        mass, correction, positive = _block_mass(p_row_ptr, block_start, vocab, sup_ids, sup_delta, HAS_SUPPORT,
                                                 BLOCK_V)
        total_plain = total_plain + mass
        total_residual = total_residual + (mass - correction)
        num_positive += positive
    if HAS_SUPPORT:
        # Exact emptiness test: positive residual entries = positive p entries off the support + positive residuals
        # on it (counts, so no round-off).
        use_residual = (num_positive - sup_p_positive + sup_residual_positive) > 0
        total = tl.where(use_residual, total_residual, total_plain)
        sup_delta = tl.where(use_residual, sup_delta, 0.0)
        sup_valid = sup_valid & (tl.zeros_like(sup_ids) + use_residual.to(sup_ids.dtype) > 0)
    else:
        total = total_plain
    threshold = u.to(tl.float64) * total

    # Pass 2: the first block whose running mass reaches the threshold (the last block at worst: it ends at total).
    start = 0
    mass, correction, _ = _block_mass(p_row_ptr, start, vocab, sup_ids, sup_delta, HAS_SUPPORT, BLOCK_V)
    prefix = tl.zeros([], dtype=tl.float64)
    next_prefix = prefix + (mass - correction)
    while (next_prefix < threshold) & (start + BLOCK_V < vocab):
        start += BLOCK_V
        prefix = next_prefix
        mass, correction, _ = _block_mass(p_row_ptr, start, vocab, sup_ids, sup_delta, HAS_SUPPORT, BLOCK_V)
        next_prefix = prefix + (mass - correction)

    # Inside it: the first index whose cumulative mass reaches the threshold and that has mass of its own.
    not_found = vocab
    index = not_found
    last_positive = -1
    running = prefix
    for sub in range(start, start + BLOCK_V, SUB_V):
        offs = sub + tl.arange(0, SUB_V)
        in_vocab = offs < vocab
        r = tl.load(p_row_ptr + offs, mask=in_vocab, other=0.0)
        if HAS_SUPPORT:
            hit = (offs[:, None] == sup_ids[None, :]) & sup_valid[None, :]
            on_support = tl.max(hit.to(tl.int32), axis=1) > 0
            r = tl.where(on_support, tl.max(tl.where(hit, sup_res[None, :], 0.0), axis=1), r)
        cdf = running + tl.cumsum(r.to(tl.float64), axis=0)
        crossing = (cdf >= threshold) & (r > 0.0) & in_vocab
        index = tl.minimum(index, tl.min(tl.where(crossing, offs, not_found), axis=0))
        last_positive = tl.maximum(last_positive, tl.max(tl.where((r > 0.0) & in_vocab, offs, -1), axis=0))
        running = running + tl.sum(r.to(tl.float64), axis=0)
    # Round-off guard: a block that reached the threshold in pass 2 but not here ends on its last positive entry;
    # a row with no mass at all gives its first index, as searchsorted does.
    fallback = tl.where(last_positive >= 0, last_positive, start)
    return tl.where(index < not_found, index, fallback)


@triton.jit(do_not_specialize=["vocab", "num_support", "stride_p", "stride_q", "stride_out", "max_k"])
def _rejection_sample_kernel(
    target_probs_ptr, draft_ids_ptr, q_ids_ptr, q_probs_ptr, num_draft_ptr, accept_u_ptr, sample_u_ptr,
    out_ptr, num_accepted_ptr,
    vocab, num_support, stride_p, stride_q, stride_out, out_width, max_k,
    OUT_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr, SUB_V: tl.constexpr,
):
    seq = tl.program_id(0)
    # Padded layout: sequence b owns draft rows b*max_k + j and target rows b*(max_k+1) + j.
    d_begin = seq * max_k
    t_begin = seq * (max_k + 1)
    num_draft = tl.load(num_draft_ptr + seq).to(tl.int32)

    # Accept tests for all draft positions at once: u * q(d) < p(d).
    pos = tl.arange(0, OUT_PAD)
    pos_valid = pos < num_draft
    draft_rows = d_begin + pos
    target_rows = t_begin + pos
    draft = tl.load(draft_ids_ptr + draft_rows, mask=pos_valid, other=0)
    p_of_draft = tl.load(target_probs_ptr + target_rows * stride_p + draft, mask=pos_valid, other=0.0)
    ks = tl.arange(0, K_PAD)
    k_valid = ks < num_support
    qmask = pos_valid[:, None] & k_valid[None, :]
    q_ids = tl.load(q_ids_ptr + draft_rows[:, None] * stride_q + ks[None, :], mask=qmask, other=-1)
    q_probs = tl.load(q_probs_ptr + draft_rows[:, None] * stride_q + ks[None, :], mask=qmask, other=0.0)
    q_of_draft = tl.sum(tl.where(q_ids == draft[:, None], q_probs, 0.0), axis=1)
    accept_u = tl.load(accept_u_ptr + draft_rows, mask=pos_valid, other=0.0)
    rejected = pos_valid & ~(accept_u * q_of_draft < p_of_draft)
    num_acc = tl.min(tl.where(rejected, pos, num_draft), axis=0)

    # The row to sample from, and q's support there if a draft token was rejected (else no support: bonus token).
    row = t_begin + num_acc
    p_row_ptr = target_probs_ptr + row.to(tl.int64) * stride_p
    # (Vector compare, not a broadcast scalar one: the CPU interpreter keeps scalar comparisons as int32.)
    recover = (tl.zeros([K_PAD], dtype=tl.int32) + num_acc) < num_draft
    sup_row = d_begin + num_acc
    sup_ids = tl.load(q_ids_ptr + sup_row * stride_q + ks, mask=k_valid & recover, other=-1)
    sup_q = tl.load(q_probs_ptr + sup_row * stride_q + ks, mask=k_valid & recover, other=0.0)
    sup_valid = k_valid & recover & (sup_ids >= 0) & (sup_ids < vocab)
    same_id = (sup_ids[:, None] == sup_ids[None, :]) & sup_valid[:, None] & sup_valid[None, :]
    # Dense q at each support id (duplicates summed, as scatter_add does), and the residual there, in float32.
    q_dense = tl.sum(tl.where(same_id, sup_q[None, :], 0.0), axis=1)
    p_at = tl.load(p_row_ptr + sup_ids, mask=sup_valid, other=0.0)
    sup_res = tl.maximum(p_at - q_dense, 0.0)
    earlier_same = tl.max((same_id & (ks[None, :] < ks[:, None])).to(tl.int32), axis=1) > 0
    first = sup_valid & ~earlier_same
    sup_delta = tl.where(first, p_at.to(tl.float64) - sup_res.to(tl.float64), 0.0)
    sup_residual_positive = tl.sum((first & (sup_res > 0.0)).to(tl.int32), axis=0)
    sup_p_positive = tl.sum((first & (p_at > 0.0)).to(tl.int32), axis=0)

    u = tl.load(sample_u_ptr + row)
    token = _sample_row(p_row_ptr, vocab, u, sup_ids, sup_res, sup_valid, sup_delta, sup_residual_positive,
                        sup_p_positive, True, BLOCK_V, SUB_V)

    out = tl.where(pos < num_acc, draft, -1)
    out = tl.where(pos == num_acc, token.to(tl.int64), out)
    tl.store(out_ptr + seq * stride_out + pos, out, mask=pos < out_width)
    tl.store(num_accepted_ptr + seq, num_acc.to(tl.int64))


@triton.jit(do_not_specialize=["vocab", "stride_p"])
def _sample_from_probs_kernel(probs_ptr, uniforms_ptr, out_ptr, vocab, stride_p,
                              BLOCK_V: tl.constexpr, SUB_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    u = tl.load(uniforms_ptr + row)
    none_i = tl.zeros([1], dtype=tl.int64)
    none_f = tl.zeros([1], dtype=tl.float32)
    none_d = tl.zeros([1], dtype=tl.float64)
    none_b = none_i > 0
    token = _sample_row(probs_ptr + row * stride_p, vocab, u, none_i, none_f, none_b, none_d, 0, 0,
                        False, BLOCK_V, SUB_V)
    tl.store(out_ptr + row, token.to(tl.int64))


def _vocab_blocks(vocab: int, block_v: int | None) -> tuple[int, int]:
    block_v = block_v or min(2048, triton.next_power_of_2(vocab))
    return block_v, min(block_v, 128)


def sample_from_probs_triton(
    probs: torch.Tensor, uniforms: torch.Tensor, *, block_v: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract as `sample_from_probs_torch`: [N, V] probs (rows need not be normalised), [N] u -> [N] int64.
    `block_v` (tests) sets the vocabulary block; `out` ([N] int64) is written instead of a new tensor."""
    probs = probs if probs.stride(-1) == 1 else probs.contiguous()
    num_rows, vocab = probs.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    if num_rows:
        block_v, sub_v = _vocab_blocks(vocab, block_v)
        _sample_from_probs_kernel[(num_rows,)](probs, uniforms.to(torch.float32).contiguous(), out, vocab,
                                               probs.stride(0), BLOCK_V=block_v, SUB_V=sub_v, num_warps=8)
    return out


def rejection_sample_triton(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    q_token_ids: torch.Tensor,
    q_probs: torch.Tensor,
    num_draft: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    *,
    block_v: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rejection_sample_torch` (padded layout). `block_v` (tests) sets the vocabulary block;
    `out` = (output, num_accepted) are written instead of new tensors."""
    num_seqs, width, vocab = target_probs.shape
    max_k = width - 1
    device = target_probs.device
    if out is None:
        output = torch.empty((num_seqs, width), dtype=torch.int64, device=device)
        num_accepted = torch.empty(num_seqs, dtype=torch.int64, device=device)
    else:
        output, num_accepted = out
    if num_seqs == 0:
        return output, num_accepted
    target_probs = target_probs.reshape(num_seqs * width, vocab)
    target_probs = target_probs if target_probs.stride(-1) == 1 else target_probs.contiguous()
    num_support = q_token_ids.shape[-1] if max_k else 1
    q_token_ids = q_token_ids.reshape(num_seqs * max_k, num_support).contiguous()
    q_probs = q_probs.reshape(num_seqs * max_k, num_support).to(torch.float32).contiguous()
    block_v, sub_v = _vocab_blocks(vocab, block_v)
    _rejection_sample_kernel[(num_seqs,)](
        target_probs, draft_token_ids.reshape(-1).contiguous(), q_token_ids, q_probs, num_draft.contiguous(),
        accept_uniforms.reshape(-1).to(torch.float32).contiguous(), sample_uniforms.reshape(-1).to(torch.float32).contiguous(),
        output, num_accepted,
        vocab, num_support, target_probs.stride(0), max(num_support, 1), output.stride(0), width, max_k,
        OUT_PAD=triton.next_power_of_2(width), K_PAD=triton.next_power_of_2(max(num_support, 1)),
        BLOCK_V=block_v, SUB_V=sub_v, num_warps=8,
    )
    return output, num_accepted
