"""Row reductions whose result for a row does not depend on the rows beside it, nor on how long the row was padded:
the batch-invariant mode's building blocks where torch's own reductions give no such promise (kernels/dispatch.py).

torch chooses how to reduce from the whole tensor's shape: a lone row of a sum or cumsum on a GPU is split over
many thread blocks (several rows are not), a CPU reduction is split over threads above a size, and `topk` picks its
algorithm by the number of rows, which decides which of two equal values comes first. Each function here fixes the
order instead, using only elementwise adds (exact IEEE operations, the same on every element):

- `ordered_sum`: a pairwise tree over the row's indices, padded to a power of two with -0.0 (x + -0.0 == x for every
  x, signed zeros included), so padding a row further leaves its sum bit for bit unchanged.
- `ordered_cumsum`: a Hillis-Steele scan; element i is a fixed tree of elements 0..i.
- `ordered_top_k`: the k largest values, equal values ordered by index (lowest first), as a topk of unique keys.
"""

import torch

# Products the mode's elementwise references (linear_torch, paged_attention_torch) hold at once: 16 MiB of float32.
BLOCK_ELEMENTS = 1 << 22


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, in x's dtype, by the fixed pairwise tree. [..., n] -> [...]."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.cat([x, x.new_full((*x.shape[:-1], width - n), -0.0)], dim=-1)
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def ordered_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums over the last dim, in x's dtype, by a scan of log2(n) shifted adds. [..., n]."""
    n, shift = x.shape[-1], 1
    while shift < n:
        x = torch.cat([x[..., :shift], x[..., shift:] + x[..., :-shift]], dim=-1)
        shift *= 2
    return x


_LOW32 = 0xFFFFFFFF


def ordered_top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row, largest first; among equal values the lower index
    first. float32 rows: one topk over int64 keys (the value's order-preserving bits, then the inverted index), which
    are all distinct, so every algorithm returns the same; other dtypes: a stable sort."""
    if x.dtype != torch.float32:
        values, indices = x.sort(dim=-1, descending=True, stable=True)
        return values[..., :k], indices[..., :k]
    bits = (x + 0.0).view(torch.int32)  # + 0.0: -0.0 ties with 0.0, as in the sort
    ordered_bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # monotone in the float's value
    index = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    keys = ordered_bits * (1 << 32) + (_LOW32 - index)
    indices = _LOW32 - (keys.topk(k, dim=-1).values & _LOW32)
    return x.gather(-1, indices), indices
