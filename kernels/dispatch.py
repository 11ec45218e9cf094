"""The kernels the services call: the Triton version on a CUDA device when Triton imports, the torch reference
everywhere else. SPECSPLIT_KERNELS=torch|triton forces one (read at each call, so tests can switch it).

The batch-invariant mode (SPECSPLIT_BATCH_INVARIANT=1, read once at import, or `set_batch_invariant(True)`, which
`--batch-invariant` calls and which sets the variable for child processes too) makes every kernel on a model's path
give a row bit for bit the same result whatever else is in its batch: how many rows, which k, the row's position,
how its prompt was chunked. Its decision points:
`linear` (a GEMM whose tiles and K split depend on (N, K, dtype) only, instead of torch's matmul), `paged_attention`
(one tile shape and a fixed split size along the context for every query count), the torch references of RMSNorm,
SiLU and attention (fixed reduction orders, rows one by one), and the row reductions of sampling (`sum_rows`,
`cumsum_rows`, `top_k_rows`). The GPU kernels of RMSNorm, rotary, SiLU and sampling already compute one row per
program and need no change. CUDA graphs keep the kernels of the mode they were captured in: set the mode before a
model runs.

The Triton modules are imported on first use, not here: importing this module never compiles or decorates a kernel,
so the services load the same way on machines with and without Triton.
"""

import contextlib
import functools
import os

import torch
import torch.nn.functional as F

from specsplit.kernels.counter_rng import counter_uniform_torch
from specsplit.kernels.invariant_reductions import ordered_cumsum, ordered_sum, ordered_top_k
from specsplit.kernels.linear import linear_torch
from specsplit.kernels.kv_write import write_kv_torch
from specsplit.kernels.paged_attention import paged_attention_torch
from specsplit.kernels.rejection_sampling import rejection_sample_torch, sample_from_probs_torch
from specsplit.kernels.rms_norm import add_rms_norm_torch
from specsplit.kernels.rotary_kv import rotary_kv_torch
from specsplit.kernels.silu_mul import silu_mul_torch
from specsplit.kernels.skinny_linear import skinny_takes
from specsplit.kernels.typical_acceptance import typical_accept_torch

ENV_VAR = "SPECSPLIT_KERNELS"
SKINNY_ENV = "SPECSPLIT_SKINNY_LINEAR"  # "off": few-row matmuls stay on torch's (A/B runs of the fused kernels)
FUSED_ROTARY_ENV = "SPECSPLIT_FUSED_ROTARY"  # "off": the one-row q/k/v kernel leaves rotary to its own kernel (A/B)
BATCH_INVARIANT_ENV = "SPECSPLIT_BATCH_INVARIANT"


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


def _mode_from_environment() -> bool:
    value = os.environ.get(BATCH_INVARIANT_ENV, "0")
    if value not in ("0", "1", ""):
        raise ValueError(f"{BATCH_INVARIANT_ENV} must be 0 or 1, not {value!r}")
    return value == "1"


# Read once: every kernel call consults the mode, and a process's mode is fixed before its first model runs.
_MODE = _mode_from_environment()


def batch_invariant() -> bool:
    """Whether the batch-invariant mode is on (SPECSPLIT_BATCH_INVARIANT at import: 1 on, 0 or unset off; then
    `set_batch_invariant`)."""
    return _MODE


def set_batch_invariant(on: bool) -> None:
    """Switch the mode for this process, and for the processes it starts (through the environment)."""
    global _MODE
    _MODE = bool(on)
    os.environ[BATCH_INVARIANT_ENV] = "1" if on else "0"


def on_device(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (a model on cuda:1 beside one on cuda:0)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a matmul goes to the few-rows kernel (kernels/skinny_linear.py): 16-bit, where it wins
    (`skinny_takes`: one row of a small model's weight or of an lm_head), on Triton, outside the batch-invariant
    mode (whose GEMM fixes its arithmetic by shape, not by rows). The dtype first: a float32 CPU call, the common
    one off a GPU, is answered by one comparison."""
    return (x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 and skinny_takes(x.shape[0], *weight.shape)
            and weight.dtype == x.dtype and not batch_invariant() and os.environ.get(SKINNY_ENV, "on") != "off"
            and use_triton(x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias. Default: the few-rows kernel for a one-row step of a small model or an lm_head on a GPU,
    torch's F.linear (cuBLAS, the CPU's BLAS) otherwise. Batch-invariant: the Triton GEMM on a GPU (16- and 32-bit
    floats), the fixed-order torch reference elsewhere."""
    if _skinny(x, weight):
        from specsplit.kernels.skinny_linear_triton import skinny_linear_triton

        with on_device(x):
            return skinny_linear_triton(x, weight, bias)
    if not batch_invariant():
        return F.linear(x, weight, bias)
    if use_triton(x) and x.dtype in (torch.bfloat16, torch.float16, torch.float32):
        from specsplit.kernels.linear_triton import linear_triton

        with on_device(x):
            return linear_triton(x, weight, bias)
    return linear_torch(x, weight, bias)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    max_query_len: int, max_seq_len: int) -> torch.Tensor:
    ordered = batch_invariant()
    if use_triton(query):
        from specsplit.kernels.paged_attention_triton import paged_attention_triton

        with on_device(query):
            return paged_attention_triton(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                          max_query_len, max_seq_len, ordered=ordered)
    return paged_attention_torch(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                 max_query_len, max_seq_len, ordered=ordered)


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
            return add_rms_norm_triton(x, residual, weight, eps)  # one program per row: invariant as it is
    return add_rms_norm_torch(x, residual, weight, eps, ordered=batch_invariant())


def norm_linear(x, residual, norm_weight, eps: float, weight, bias, silu_mul_after: bool = False):
    """(linear(weight * rmsnorm(x + residual)) [then SiLU * up], x + residual): one kernel for a decode step's rows
    on a GPU where the few-rows kernel takes it, add_rms_norm then linear [then silu_mul] otherwise."""
    if _skinny(x, weight) and norm_weight.dtype == x.dtype:
        from specsplit.kernels.skinny_linear_triton import norm_linear_triton

        with on_device(x):
            return norm_linear_triton(x, residual, norm_weight, eps, weight, bias, silu_mul=silu_mul_after)
    normed, residual = add_rms_norm(x, residual, norm_weight, eps)
    out = linear(normed, weight, bias)
    return (silu_mul(out) if silu_mul_after else out), residual


def norm_qkv_rotary(x, residual, norm_weight, eps: float, weight, bias, positions, cos_sin, key_cache, value_cache,
                    slot_mapping, num_heads: int, num_kv_heads: int, head_dim: int):
    """(q rotated, x + residual), k and v written to the cache: a layer's attention input. One kernel where the
    few-rows kernel takes the q/k/v projection on a GPU (the norm in its prologue, rotary and the cache write in its
    epilogue); norm_linear then rotary_kv otherwise."""
    if _skinny(x, weight) and norm_weight.dtype == x.dtype and os.environ.get(FUSED_ROTARY_ENV, "on") != "off":
        from specsplit.kernels.skinny_linear_triton import norm_qkv_rotary_triton, rotary_pairs_per_program

        if rotary_pairs_per_program(head_dim) is not None:
            with on_device(x):
                return norm_qkv_rotary_triton(x, residual, norm_weight, eps, weight, bias, positions, cos_sin,
                                              key_cache, value_cache, slot_mapping, num_heads, num_kv_heads,
                                              head_dim)
    qkv, residual = norm_linear(x, residual, norm_weight, eps, weight, bias)
    return rotary_kv(qkv, positions, cos_sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads,
                     head_dim), residual


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
            return silu_mul_triton(gate_up)  # elementwise: invariant as it is
    return silu_mul_torch(gate_up, ordered=batch_invariant())


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
                                posterior_alpha, sample=sample_from_probs,
                                ordered=batch_invariant())


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


# Row reductions of sampling and logprobs: torch's own by default, fixed-order ones in the batch-invariant mode
# (kernels/invariant_reductions.py says where torch's depend on the batch).


def sum_rows(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim."""
    return ordered_sum(x) if batch_invariant() else x.sum(dim=-1)


def cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums over the last dim."""
    return ordered_cumsum(x) if batch_invariant() else x.cumsum(dim=-1)


def top_k_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of each row's k largest, largest first (equal values: lower index first in the mode)."""
    return ordered_top_k(x, k) if batch_invariant() else x.topk(k, dim=-1)

