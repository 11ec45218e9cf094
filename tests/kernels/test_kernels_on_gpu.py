"""On a real CUDA GPU: the compiled kernels at model-sized shapes (Qwen2.5-7B attention layout, a 152k vocabulary)
against the references. Skipped without a GPU; the other tests in this folder also run compiled there."""

import pytest
import torch

from paged_batch_inputs import make_paged_batch, relative_error
from specsplit.kernels.counter_rng import STREAM_ACCEPT, counter_uniform_torch
from specsplit.kernels.counter_rng_triton import counter_uniform_triton
from specsplit.kernels.paged_attention import paged_attention_torch
from specsplit.kernels.paged_attention_triton import paged_attention_triton
from specsplit.kernels.rejection_sampling import rejection_sample_torch, sample_from_probs_torch
from specsplit.kernels.rejection_sampling_triton import rejection_sample_triton, sample_from_probs_triton
from test_rejection_sampling import padded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("query_len", [1, 5])
def test_attention_qwen7b_layout_long_context(block_size, query_len, generator):
    # Decode and verification (k+1 = 5) at long contexts of different lengths: the split-KV path at batch 3.
    batch = make_paged_batch([query_len] * 3, [4099, 1500, 8000], 28, 4, 128, block_size, torch.float32, "cuda",
                             generator)
    want = paged_attention_torch(*batch.args())  # fp32 reference on the GPU (SDPA, fp32 accumulation)
    low = batch.to(torch.bfloat16)
    out = torch.full_like(low.query, float("nan"))
    got = paged_attention_triton(*low.args(), out=out)
    assert not got.isnan().any()
    assert relative_error(got, want) < 1.5e-2


def test_attention_mixed_batch_fp16_head_dim_64(generator):
    batch = make_paged_batch([1, 2, 5, 300, 5], [900, 40, 1000, 700, 5], 14, 2, 64, 16, torch.float32, "cuda",
                             generator)
    want = paged_attention_torch(*batch.args())
    got = paged_attention_triton(*batch.to(torch.float16).args())
    assert relative_error(got, want) < 4e-3


def test_attention_fp32_is_tight(generator):
    batch = make_paged_batch([1, 5, 64], [3000, 700, 64], 12, 2, 128, 16, torch.float32, "cuda", generator)
    want = paged_attention_torch(*batch.to(torch.float64).args())
    assert relative_error(paged_attention_triton(*batch.args()), want) < 1e-5


def test_counter_uniform_compiled_is_bit_identical(generator):
    seeds = torch.randint(-2**63, 2**63 - 1, (1 << 20,), dtype=torch.int64, generator=generator)
    positions = torch.randint(0, 2**40, (1 << 20,), dtype=torch.int64, generator=generator)
    want = counter_uniform_torch(seeds, positions, STREAM_ACCEPT)
    got = counter_uniform_triton(seeds.cuda(), positions.cuda(), STREAM_ACCEPT).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_rejection_sampling_full_vocabulary(generator):
    vocab, support, num_draft = 151_936, 32, [5, 5, 0, 3, 5, 1, 5, 5]
    total, num_seqs = sum(num_draft), len(num_draft)
    cu = torch.tensor([0] + torch.tensor(num_draft).cumsum(0).tolist())
    logits = torch.randn(total + num_seqs, vocab, generator=generator) * 3
    p = torch.softmax(logits, -1)
    q_probs, q_ids = torch.softmax(logits[:total] + 0.3 * torch.randn(total, vocab, generator=generator), -1).topk(
        support, -1)
    q_probs = q_probs / q_probs.sum(1, keepdim=True)
    draft = q_ids.gather(1, torch.multinomial(q_probs, 1, generator=generator)).squeeze(1)
    accept_u, sample_u = torch.rand(total, generator=generator), torch.rand(total + num_seqs, generator=generator)
    batch = padded(num_draft, p, draft, q_ids, q_probs, accept_u, sample_u)
    want = rejection_sample_torch(*batch)
    got = rejection_sample_triton(*[t.cuda() for t in batch])
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    rows = sample_from_probs_triton(p.cuda(), sample_u.cuda())
    assert torch.equal(rows.cpu(), sample_from_probs_torch(p, sample_u))
