"""Rotary position embedding with the scaling the config asks for (linear, dynamic, yarn, llama3, longrope, ...).

The inverse frequencies come from transformers' own rope initialisers so every rope variant it knows is computed
the same way here; cos/sin are then applied to flat [tokens, heads, head_dim] tensors at arbitrary positions.
"""

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _default_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    base = hf_config.rope_parameters["rope_theta"]
    # float32 arithmetic, exactly as transformers computes it, so positions rotate bit-identically.
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int):
        super().__init__()
        params = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        rope_type = params.get("rope_type", "default")
        with torch.device("cpu"):  # frequencies are real numbers even when the model is built on the meta device
            inv_freq, scaling = self._inverse_frequencies(hf_config, head_dim, rope_type)
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
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

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """positions [T]; query [T, H, D]; key [T, KVH, D] -> rotated (query, key), same dtypes."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling)[:, None, :]
        sin = (emb.sin() * self.attention_scaling)[:, None, :]
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.to(x.dtype) + rotated_half * sin.to(x.dtype)).to(x.dtype)
