"""y = x @ weight^T + bias with a fixed reduction order per output element: the batch-invariant mode's matmul,
eager torch reference (the default mode calls torch's own F.linear instead: kernels/dispatch.py).

torch's CPU matmul is not batch-invariant: one row goes to a matrix-vector kernel, several to a blocked GEMM whose
blocking follows the row count, and the two add the K products in different orders. Here every output element is
the same computation whatever else is computed beside it: its K products (exact for bf16/fp16 inputs in float32),
then `ordered_sum`'s fixed pairwise tree over K in float32 (float64 for float64 inputs), then the bias, then one
rounding to x's dtype. Rows and output columns are taken in blocks only to bound the memory of the products.

It is slow (elementwise work instead of a GEMM: seconds per token for a 1.5B model on the CPU); the mode exists to
make output bit-exact, and on a GPU it runs the Triton GEMM (kernels/linear_triton.py).

    x: [..., K]; weight: [N, K]; bias: [N] or None -> [..., N] in x's dtype
"""

import torch

from specsplit.kernels.invariant_reductions import BLOCK_ELEMENTS, ordered_sum


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    *lead, k = x.shape
    n = weight.shape[0]
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = x.reshape(-1, k)
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    cols_per_block = max(1, min(n, BLOCK_ELEMENTS // max(k, 1)))
    rows_per_block = max(1, BLOCK_ELEMENTS // (cols_per_block * max(k, 1)))
    for c in range(0, n, cols_per_block):
        w = weight[c:c + cols_per_block].to(accumulate)
        b = bias[c:c + cols_per_block].to(accumulate) if bias is not None else None
        for r in range(0, rows.shape[0], rows_per_block):
            y = ordered_sum(rows[r:r + rows_per_block, None, :].to(accumulate) * w[None, :, :])
            if b is not None:
                y = y + b
            out[r:r + rows_per_block, c:c + cols_per_block] = y.to(x.dtype)
    return out.reshape(*lead, n)
