"""Rotary position embedding with the scaling the config asks for (linear, dynamic, yarn, llama3, longrope, ...).

The inverse frequencies come from transformers' own rope initialisers so every rope variant it knows is computed
the same way here. cos/sin of every position the model serves are tabled once (`cos_sin`, float32, built on the
CPU exactly as transformers computes them per call); the attention's fused rotary + KV-write kernel reads them.
"""

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specsplit.kernels.rotary_kv import rotary_table

# Positions past the served context that padding rows of a captured batch may carry (see runtime/cuda_graphs.py).
PADDING_POSITIONS = 64


def _default_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    base = hf_config.rope_parameters["rope_theta"]
    # float32 arithmetic, exactly as transformers computes it, so positions rotate bit-identically.
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int):
        super().__init__()
        params = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        rope_type = params.get("rope_type", "default")
        positions = int(getattr(hf_config, "max_position_embeddings", 0) or 4096) + PADDING_POSITIONS
        with torch.device("cpu"):  # frequencies are real numbers even when the model is built on the meta device
            inv_freq, scaling = self._inverse_frequencies(hf_config, head_dim, rope_type)
            inv_freq = inv_freq.to(torch.float32)
            cos_sin = rotary_table(inv_freq, float(scaling), positions)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos_sin", cos_sin, persistent=False)
        self.attention_scaling = float(scaling)

    @staticmethod
    def _inverse_frequencies(hf_config, head_dim, rope_type):
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(hf_config, head_dim)
        elif rope_type == "dynamic":
            # Dynamic NTK rescales with the running length; served exactly only within the original length.
            inv_freq, scaling = _default_inv_freq(hf_config, head_dim)
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        return inv_freq, scaling
