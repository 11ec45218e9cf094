"""The gated MLP's activation, SiLU(gate) * up, over the fused gate/up projection, eager torch reference.

    gate_up: [tokens, 2 * intermediate] (gate then up) -> [tokens, intermediate]
"""

import torch
import torch.nn.functional as F


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
