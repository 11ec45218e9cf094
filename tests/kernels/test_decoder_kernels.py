"""The decoder's fused kernels (add + RMSNorm, rotary + KV write, SiLU * up) against their torch references, and
the references against the unfused arithmetic they replace."""

import pytest
import torch
import torch.nn.functional as F

from specsplit.kernels.kv_write import write_kv_torch
from specsplit.kernels.rms_norm import add_rms_norm_torch
from specsplit.kernels.rms_norm_triton import add_rms_norm_triton
from specsplit.kernels.rotary_kv import rotary_kv_torch, rotary_table
from specsplit.kernels.rotary_kv_triton import rotary_kv_triton
from specsplit.kernels.silu_mul import silu_mul_torch
from specsplit.kernels.silu_mul_triton import silu_mul_triton


def _rms_norm_as_transformers(x, weight, eps):
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_reference_is_the_add_then_transformers_norm(dtype, generator):
    x = torch.randn(5, 48, generator=generator).to(dtype)
    residual = torch.randn(5, 48, generator=generator).to(dtype)
    weight = torch.randn(48, generator=generator).to(dtype)
    out, new_residual = add_rms_norm_torch(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, _rms_norm_as_transformers(x + residual, weight, 1e-6))
    out, same = add_rms_norm_torch(x, None, weight, 1e-6)
    assert same is x and torch.equal(out, _rms_norm_as_transformers(x, weight, 1e-6))


@pytest.mark.parametrize("dtype, hidden", [(torch.float32, 48), (torch.bfloat16, 96), (torch.float32, 100)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_triton_matches_reference(dtype, hidden, with_residual, device, generator):
    x = torch.randn(7, hidden, generator=generator).to(dtype=dtype, device=device)
    residual = torch.randn(7, hidden, generator=generator).to(dtype=dtype, device=device) if with_residual else None
    weight = torch.randn(hidden, generator=generator).to(dtype=dtype, device=device)
    out, new_residual = add_rms_norm_triton(x, residual, weight, 1e-5)
    want, want_residual = add_rms_norm_torch(x.cpu(), residual.cpu() if with_residual else None, weight.cpu(), 1e-5)
    assert torch.equal(new_residual.cpu(), want_residual)  # the add rounds exactly as torch's
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the sum of squares may be taken in another order
    torch.testing.assert_close(out.cpu(), want, rtol=tolerance, atol=tolerance)


def test_rotary_table_equals_angles_computed_per_call():
    inv_freq = 1.0 / (1_000_000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    table = rotary_table(inv_freq, 1.0, 5000)
    positions = torch.tensor([0, 1, 17, 4095, 4999])
    freqs = positions[:, None].to(torch.float32) * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # how transformers (and the per-call path) builds them
    assert torch.equal(table[positions, 0], emb.cos()[:, :32]) and torch.equal(table[positions, 1], emb.sin()[:, 32:])


def _rotate_as_transformers(x, positions, inv_freq):
    freqs = positions[:, None].to(torch.float32) * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :].to(x.dtype), emb.sin()[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rotary_inputs(dtype, device, generator, tokens=6, heads=4, kv_heads=2, head_dim=16, blocks=5, block_size=4):
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype=dtype, device=device)
    positions = torch.randint(0, 300, (tokens,), generator=generator).to(device)
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
    slots[1] = -1  # padding: not written
    shape = (blocks, block_size, kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(2)]
    return qkv, positions, slots.to(device), caches


def test_rotary_kv_reference_is_transformers_rotation_plus_kv_write(generator):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    qkv, positions, slots, (key_cache, value_cache) = _rotary_inputs(torch.bfloat16, "cpu", generator)
    q = rotary_kv_torch(qkv, positions, rotary_table(inv_freq, 1.0, 300), key_cache, value_cache, slots, 4, 2, 16)
    want_q = _rotate_as_transformers(qkv[:, :64].reshape(-1, 4, 16), positions, inv_freq)
    want_k = _rotate_as_transformers(qkv[:, 64:96].reshape(-1, 2, 16), positions, inv_freq)
    assert torch.equal(q, want_q)
    expected_k, expected_v = (torch.full_like(key_cache, float("nan")) for _ in range(2))
    write_kv_torch(want_k, qkv[:, 96:].reshape(-1, 2, 16), expected_k, expected_v, slots)
    assert torch.equal(key_cache.nan_to_num(7.0), expected_k.nan_to_num(7.0))
    assert torch.equal(value_cache.nan_to_num(7.0), expected_v.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kv_triton_is_bit_identical_to_reference(dtype, device, generator):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    table = rotary_table(inv_freq, 1.0, 300)
    qkv, positions, slots, (key_cache, value_cache) = _rotary_inputs(dtype, device, generator)
    want_caches = [key_cache.cpu().clone(), value_cache.cpu().clone()]
    want_q = rotary_kv_torch(qkv.cpu(), positions.cpu(), table, *want_caches, slots.cpu(), 4, 2, 16)
    q = rotary_kv_triton(qkv, positions, table.to(device), key_cache, value_cache, slots, 4, 2, 16)
    assert torch.equal(q.cpu(), want_q)
    assert torch.equal(key_cache.cpu().nan_to_num(7.0), want_caches[0].nan_to_num(7.0))
    assert torch.equal(value_cache.cpu().nan_to_num(7.0), want_caches[1].nan_to_num(7.0))


def test_silu_mul_reference_is_silu_of_gate_times_up(generator):
    gate_up = torch.randn(3, 40, generator=generator).to(torch.bfloat16)
    assert torch.equal(silu_mul_torch(gate_up), F.silu(gate_up[:, :20]) * gate_up[:, 20:])


@pytest.mark.parametrize("dtype, width", [(torch.float32, 40), (torch.bfloat16, 6000)])
def test_silu_mul_triton_matches_reference(dtype, width, device, generator):
    gate_up = (3 * torch.randn(4, width, generator=generator)).to(dtype=dtype, device=device)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(silu_mul_triton(gate_up).cpu(), silu_mul_torch(gate_up.cpu()), rtol=tolerance,
                               atol=tolerance)
