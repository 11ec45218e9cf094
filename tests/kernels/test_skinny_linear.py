"""The few-rows matmul with its fused prologue (residual add + RMSNorm) and epilogue (SiLU * up) against its torch
references, which are the unfused decoder's own steps."""

import pytest
import torch
import torch.nn.functional as F

from specsplit.kernels.rms_norm import add_rms_norm_torch
from specsplit.kernels.rotary_kv import rotary_table
from specsplit.kernels.rotary_kv_triton import rotary_kv_triton
from specsplit.kernels.skinny_linear import (linear_silu_mul_torch, norm_linear_torch, norm_qkv_rotary_torch,
                                            skinny_takes)
from specsplit.kernels.skinny_linear_triton import (MAX_ROWS, SkinnyConfig, linear_silu_mul_triton, norm_linear_triton,
                                                    norm_qkv_rotary_triton, skinny_config, skinny_linear_triton)
from specsplit.kernels.silu_mul import silu_mul_torch


def _tolerance(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _inputs(rows, n, k, dtype, device, generator, bias=True):
    x = torch.randn(rows, k, generator=generator).to(dtype=dtype, device=device)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype=dtype, device=device)
    b = torch.randn(n, generator=generator).to(dtype=dtype, device=device) if bias else None
    return x, weight, b


def test_references_are_the_unfused_steps(generator):
    x, weight, bias = _inputs(3, 40, 24, torch.bfloat16, "cpu", generator)
    residual = torch.randn(3, 24, generator=generator).to(torch.bfloat16)
    norm_weight = torch.randn(24, generator=generator).to(torch.bfloat16)
    out, new_residual = norm_linear_torch(x, residual, norm_weight, 1e-6, weight, bias)
    normed, want_residual = add_rms_norm_torch(x, residual, norm_weight, 1e-6)
    assert torch.equal(new_residual, want_residual) and torch.equal(out, F.linear(normed, weight, bias))
    assert torch.equal(linear_silu_mul_torch(x, weight, bias), silu_mul_torch(F.linear(x, weight, bias)))


# Shapes off every tile edge: rows 1 to MAX_ROWS, N and K not multiples of the tiles, K longer than one K tile.
SHAPES = [(1, 40, 24), (3, 100, 70), (5, 64, 300), (MAX_ROWS, 36, 1100)]


@pytest.mark.parametrize("rows, n, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_linear_matches_reference(rows, n, k, dtype, with_residual, device, generator):
    x, weight, bias = _inputs(rows, n, k, dtype, device, generator)
    residual = torch.randn(rows, k, generator=generator).to(dtype=dtype, device=device) if with_residual else None
    norm_weight = torch.randn(k, generator=generator).to(dtype=dtype, device=device)
    out, new_residual = norm_linear_triton(x, residual, norm_weight, 1e-5, weight, bias)
    want, want_residual = norm_linear_torch(x.cpu().float(), None if residual is None else residual.cpu().float(),
                                            norm_weight.cpu().float(), 1e-5, weight.cpu().float(), bias.cpu().float())
    if with_residual:
        assert torch.equal(new_residual.cpu(), (x + residual).cpu())  # the add rounds exactly as torch's
    else:
        assert new_residual is x
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), want, **_tolerance(dtype))


@pytest.mark.parametrize("rows, n, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_silu_mul_and_plain_match_reference(rows, n, k, dtype, with_bias, device, generator):
    x, weight, bias = _inputs(rows, 2 * n, k, dtype, device, generator, bias=with_bias)
    reference = (x.cpu().float(), weight.cpu().float(), None if bias is None else bias.cpu().float())
    torch.testing.assert_close(linear_silu_mul_triton(x, weight, bias).cpu().float(),
                               linear_silu_mul_torch(*reference), **_tolerance(dtype))
    torch.testing.assert_close(skinny_linear_triton(x, weight, bias).cpu().float(), F.linear(*reference),
                               **_tolerance(dtype))


def test_bf16_roundings(device, generator):
    """With a K short enough that the sums are exact: the norm's scale applied to the finished float32 sum and one
    rounding (the fused kernel rounds no normed row), and SiLU * up rounded as the unfused path rounds it."""
    x = torch.randint(-4, 5, (2, 8), generator=generator).to(torch.bfloat16).to(device)
    residual = torch.randint(-4, 5, (2, 8), generator=generator).to(torch.bfloat16).to(device)
    norm_weight = torch.randn(8, generator=generator).to(torch.bfloat16).to(device)
    weight = torch.randint(-3, 4, (12, 8), generator=generator).to(torch.bfloat16).to(device)
    out, _ = norm_linear_triton(x, residual, norm_weight, 1e-6, weight, None)
    h = (x + residual).cpu().double()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = (rstd * ((h * norm_weight.cpu().double()) @ weight.cpu().double().T)).to(torch.bfloat16)
    torch.testing.assert_close(out.cpu().float(), want.float(), rtol=2**-8, atol=0)  # at most one rounding step
    activated = linear_silu_mul_triton(x, weight, None)
    assert torch.equal(activated.cpu(), silu_mul_torch((x.cpu().float() @ weight.cpu().float().T).to(torch.bfloat16)))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_qkv_rotary_is_the_two_kernels_it_replaces(rows, with_bias, with_residual, device, generator):
    """The q/k/v kernel with rotary and the cache write in its epilogue against norm_linear then rotary_kv (both
    Triton, the same K tiles): the same q, residual stream and cache, every other cache slot untouched, no write for
    a negative slot; and against the torch references within bf16 tolerance. Exact in the interpreter; on a GPU
    within a rounding (the two kernels' column sums may reduce in different orders)."""
    heads, kv_heads, head_dim, k, block_size = 4, 2, 16, 70, 4
    x, weight, bias = _inputs(rows, (heads + 2 * kv_heads) * head_dim, k, torch.bfloat16, device, generator,
                              bias=with_bias)
    residual = torch.randn(rows, k, generator=generator).to(torch.bfloat16).to(device) if with_residual else None
    norm_weight = torch.randn(k, generator=generator).to(torch.bfloat16).to(device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos_sin = rotary_table(inv_freq, 1.0, 64).to(device)
    positions = torch.tensor([37, 5, 12][:rows], device=device)
    slots = torch.tensor([9, -1, 2][:rows], device=device)  # the second row writes nothing
    caches = [torch.randn(6, block_size, kv_heads, head_dim, generator=generator).to(torch.bfloat16).to(device)
              for _ in range(2)]
    unfused_caches = [c.clone() for c in caches]
    snapshot = [c.clone() for c in caches]

    q, new_residual = norm_qkv_rotary_triton(x, residual, norm_weight, 1e-6, weight, bias, positions, cos_sin,
                                             *caches, slots, heads, kv_heads, head_dim, block_k=128)
    qkv, want_residual = norm_linear_triton(x, residual, norm_weight, 1e-6, weight, bias, SkinnyConfig(4, 128, 4))
    want_q = rotary_kv_triton(qkv, positions, cos_sin, *unfused_caches, slots, heads, kv_heads, head_dim)
    assert torch.equal(new_residual, want_residual)
    if device.type == "cpu":
        assert torch.equal(q, want_q)
        assert all(torch.equal(c, u) for c, u in zip(caches, unfused_caches))
    else:
        torch.testing.assert_close(q, want_q, rtol=2**-7, atol=2**-7)
        for c, u in zip(caches, unfused_caches):
            torch.testing.assert_close(c, u, rtol=2**-7, atol=2**-7)
    written = torch.zeros(6 * block_size, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    for cache, before in zip(caches, snapshot):
        slots_now, slots_before = cache.reshape(-1, kv_heads, head_dim).cpu(), before.reshape(-1, kv_heads, head_dim).cpu()
        assert torch.equal(slots_now[~written], slots_before[~written])
        assert not torch.equal(slots_now[written], slots_before[written])
    want_q_torch, _ = norm_qkv_rotary_torch(
        x.cpu().float(), None if residual is None else residual.cpu().float(), norm_weight.cpu().float(), 1e-6,
        weight.cpu().float(), None if bias is None else bias.cpu().float(), positions.cpu(), cos_sin.cpu(),
        *[c.cpu().float() for c in snapshot], slots.cpu(), heads, kv_heads, head_dim)
    torch.testing.assert_close(q.cpu().float(), want_q_torch, **_tolerance(torch.bfloat16))


def test_config_one_row_streams_k_in_long_tiles_more_rows_bound_the_accumulator():
    one_row = skinny_config(1, 896, 896, False, torch.device("cpu"))
    assert (one_row.block_n, one_row.block_k) == (4, 1024)
    assert skinny_config(1, 4864, 896, True, torch.device("cpu")).block_k == 1024  # two accumulators
    long_rows = skinny_config(1, 896, 4864, False, torch.device("cpu"))
    assert (long_rows.block_n, long_rows.block_k) == (2, 2048)
    eight = skinny_config(8, 896, 896, True, torch.device("cpu"))
    assert 8 * eight.block_n * eight.block_k * 2 <= 1024 * eight.num_warps


def test_the_default_route_is_one_row_of_a_small_weight_or_an_lm_head():
    assert skinny_takes(1, 9728, 896) and skinny_takes(1, 896, 4864)  # the 0.5B draft's gate/up and down
    assert skinny_takes(1, 152064, 3584)  # the 7B's lm_head
    assert not skinny_takes(1, 37888, 3584)  # the 7B's gate/up: cuBLAS streams it faster
    assert not skinny_takes(2, 9728, 896)  # more rows share CUDA cores: cuBLAS's tensor cores win


def test_more_rows_than_the_kernel_takes_is_an_error(device):
    x = torch.zeros(MAX_ROWS + 1, 8, device=device)
    with pytest.raises(ValueError, match="at most"):
        skinny_linear_triton(x, torch.zeros(4, 8, device=device), None, SkinnyConfig(4, 32, 4))


def test_a_decode_step_through_the_fused_kernels_computes_the_unfused_logits(tmp_path, monkeypatch, device):
    """The decoder wired to the fused kernels (norm into q/k/v and gate/up, rotary and the KV write into q/k/v, SiLU *
    up into gate/up): a bf16 tiny model's one-row decode step gives the logits of the unfused kernels, every other
    kernel the same (all Triton). The decode's logits read the KV the fused kernel wrote for its token."""
    from specsplit.kernels import dispatch
    from specsplit.services.models.loader import load_model
    from specsplit.services.runtime.model_runner import ForwardItem, ModelRunner
    from tiny_models import build_model, save_model

    save_model(build_model("qwen2", seed=3), tmp_path / "m", with_tokenizer=False)
    loaded = load_model(str(tmp_path / "m"), dtype="bfloat16", device=device)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    calls = []

    def counting(real):
        def call(*args, **kwargs):
            calls.append((real.__name__, dispatch._skinny(args[0], args[4])))
            return real(*args, **kwargs)
        return call

    for name in ("norm_linear", "norm_qkv_rotary"):
        monkeypatch.setattr(f"specsplit.services.models.decoder.{name}", counting(getattr(dispatch, name)))

    def decode_step(skinny: str):
        """A prompt's prefill (several rows: the unfused kernels), then one token's decode step (one row)."""
        monkeypatch.setenv(dispatch.SKINNY_ENV, skinny)
        runner = ModelRunner(loaded, num_blocks=8)
        table = runner.block_manager.allocate(0)
        prefill = ForwardItem(table, [5, 17, 99, 3], 1)
        assert runner.reserve([prefill]) == [None]
        runner.forward([prefill])
        calls.clear()
        decode = ForwardItem(table, [42], 1)
        assert runner.reserve([decode]) == [None]
        return runner.forward([decode])[0].float()

    fused = decode_step("on")
    # every norm + projection of the one-row step went to a fused kernel, q/k/v's with rotary and the KV write
    assert {name for name, _ in calls} == {"norm_linear", "norm_qkv_rotary"} and all(fused for _, fused in calls)
    unfused = decode_step("off")
    assert calls and not any(fused for _, fused in calls)
    torch.testing.assert_close(fused, unfused, rtol=3e-2, atol=3e-2)


def test_greedy_speculation_through_the_fused_kernels_equals_the_target_alone(tiny_pair, monkeypatch, device):
    """The fused one-row path end to end (bf16, every kernel Triton): the draft's one-row steps and the target's
    one-row decodes go through it; greedy speculation gives the target alone's tokens, and the target alone gives
    the tokens it gives with the fused kernels off."""
    import asyncio

    from specsplit.kernels import dispatch
    from specsplit.services.local_engine import LocalEngine
    from specsplit.services.sampling_params import SamplingParams

    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    prompts, params = [[1, 2, 3]], SamplingParams(max_tokens=7, ignore_eos=True)  # the interpreter is slow
    fused_calls = []
    skinny = dispatch._skinny
    monkeypatch.setattr(dispatch, "_skinny", lambda x, w: fused_calls.append(skinny(x, w)) or fused_calls[-1])

    def tokens(draft, fused: str):
        monkeypatch.setenv(dispatch.SKINNY_ENV, fused)
        engine = LocalEngine(tiny_pair["target"], draft, num_speculative_tokens=3 if draft else 0, dtype="bfloat16",
                             speculation="fixed", warm_up=False, device=str(device))

        async def main():
            return [(await engine.generate(p, params)).token_ids for p in prompts]

        return asyncio.run(main())

    alone = tokens(None, "on")
    assert any(fused_calls)  # the one-row decodes took the fused kernel
    assert tokens(tiny_pair["close"], "on") == alone
    assert tokens(None, "off") == alone
