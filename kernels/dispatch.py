"""The kernels the services call: the Triton version on a CUDA device when Triton imports, the torch reference
everywhere else. SPECSPLIT_KERNELS=torch|triton forces one (read at each call, so tests can switch it).

The Triton modules are imported on first use, not here: importing this module never compiles or decorates a kernel,
so the services load the same way on machines with and without Triton.
"""

import contextlib
import functools
import os

import torch

from specsplit.kernels.counter_rng import counter_uniform_torch
from specsplit.kernels.kv_write import write_kv_torch
from specsplit.kernels.paged_attention import paged_attention_torch
from specsplit.kernels.rejection_sampling import rejection_sample_torch, sample_from_probs_torch
from specsplit.kernels.rms_norm import add_rms_norm_torch
from specsplit.kernels.rotary_kv import rotary_kv_torch
from specsplit.kernels.silu_mul import silu_mul_torch
from specsplit.kernels.typical_acceptance import typical_accept_torch

ENV_VAR = "SPECSPLIT_KERNELS"


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a call on `tensor` goes to the Triton kernels."""
    choice = os.environ.get(ENV_VAR, "auto")
    if choice == "torch":
        return False
    if choice == "triton":
        if not _triton_importable():
            raise RuntimeError(f"{ENV_VAR}=triton but triton is not importable")
        return True
    if choice != "auto":
        raise ValueError(f"{ENV_VAR} must be 'torch', 'triton' or unset, not {choice!r}")
    return tensor.is_cuda and _triton_importable()


def on_device(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (a model on cuda:1 beside one on cuda:0)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    max_query_len: int, max_seq_len: int) -> torch.Tensor:
    if use_triton(query):
        from specsplit.kernels.paged_attention_triton import paged_attention_triton

        with on_device(query):
            return paged_attention_triton(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                          max_query_len, max_seq_len)
    return paged_attention_torch(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                 max_query_len, max_seq_len)


def write_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    if use_triton(key):
        from specsplit.kernels.kv_write_triton import write_kv_triton

        with on_device(key):
            return write_kv_triton(key, value, key_cache, value_cache, slot_mapping)
    return write_kv_torch(key, value, key_cache, value_cache, slot_mapping)


def add_rms_norm(x, residual, weight, eps: float):
    """(weight * rmsnorm(x + residual), x + residual); residual None = plain RMSNorm of x (and x itself)."""
    if use_triton(x):
        from specsplit.kernels.rms_norm_triton import add_rms_norm_triton

        with on_device(x):
            return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_torch(x, residual, weight, eps)


def rotary_kv(qkv, positions, cos_sin, key_cache, value_cache, slot_mapping, num_heads: int, num_kv_heads: int,
              head_dim: int):
    """Rotate q and k of the fused projection, write k and v to the cache; returns q rotated."""
    if use_triton(qkv):
        from specsplit.kernels.rotary_kv_triton import rotary_kv_triton

        with on_device(qkv):
            return rotary_kv_triton(qkv, positions, cos_sin, key_cache, value_cache, slot_mapping, num_heads,
                                    num_kv_heads, head_dim)
    return rotary_kv_torch(qkv, positions, cos_sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads,
                           head_dim)


def silu_mul(gate_up):
    if use_triton(gate_up):
        from specsplit.kernels.silu_mul_triton import silu_mul_triton

        with on_device(gate_up):
            return silu_mul_triton(gate_up)
    return silu_mul_torch(gate_up)


def rejection_sample(target_probs, draft_token_ids, q_token_ids, q_probs, num_draft, accept_uniforms,
                     sample_uniforms) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded layout (kernels/rejection_sampling.py): no host sync on either path."""
    if use_triton(target_probs):
        from specsplit.kernels.rejection_sampling_triton import rejection_sample_triton

        with on_device(target_probs):
            return rejection_sample_triton(target_probs, draft_token_ids, q_token_ids, q_probs, num_draft,
                                           accept_uniforms, sample_uniforms)
    return rejection_sample_torch(target_probs, draft_token_ids, q_token_ids, q_probs, num_draft,
                                  accept_uniforms, sample_uniforms)


def typical_accept(target_probs, draft_token_ids, num_draft, sample_uniforms, posterior_threshold,
                   posterior_alpha) -> tuple[torch.Tensor, torch.Tensor]:
    """NOT lossless (opt-in). Padded layout (kernels/typical_acceptance.py); batched tensor ops with fixed shapes and
    no host reads, the same on every device and inside CUDA graphs; only its final inverse-CDF sample goes to the
    Triton kernel where that is used."""
    return typical_accept_torch(target_probs, draft_token_ids, num_draft, sample_uniforms, posterior_threshold,
                                posterior_alpha, sample=sample_from_probs)


def sample_from_probs(probs, uniforms) -> torch.Tensor:
    if use_triton(probs):
        from specsplit.kernels.rejection_sampling_triton import sample_from_probs_triton

        with on_device(probs):
            return sample_from_probs_triton(probs, uniforms)
    return sample_from_probs_torch(probs, uniforms)


def counter_uniform(seeds, positions, stream: int) -> torch.Tensor:
    if use_triton(seeds if torch.is_tensor(seeds) else positions):
        from specsplit.kernels.counter_rng_triton import counter_uniform_triton

        with on_device(seeds if torch.is_tensor(seeds) else positions):
            return counter_uniform_triton(seeds, positions, stream)
    return counter_uniform_torch(seeds, positions, stream)
