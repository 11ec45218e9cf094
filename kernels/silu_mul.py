"""The gated MLP's activation, SiLU(gate) * up, over the fused gate/up projection, eager torch reference.

    gate_up: [tokens, 2 * intermediate] (gate then up) -> [tokens, intermediate]

`ordered` (the batch-invariant mode): each row in a call of its own. torch's CPU elementwise loops compute the
exponential with SIMD code for most elements and scalar code for the leftovers of each chunk they cut the tensor
into, and the two can differ in the last bit; one row at a time, a row's elements always meet the same code.
"""

import torch
import torch.nn.functional as F


def silu_mul_torch(gate_up: torch.Tensor, ordered: bool = False) -> torch.Tensor:
    if ordered and gate_up.shape[0] > 1:
        return torch.cat([silu_mul_torch(row) for row in gate_up.split(1)])
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
