"""The dispatchers pick Triton on CUDA tensors and the torch reference elsewhere; SPECSPLIT_KERNELS forces one."""

import pytest
import torch

from specsplit.kernels import dispatch
from specsplit.kernels.counter_rng import STREAM_SAMPLE, counter_uniform_torch
from specsplit.kernels.rejection_sampling import sample_from_probs_torch


def test_cpu_tensors_use_the_reference_unless_forced(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert not dispatch.use_triton(torch.zeros(1))
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert dispatch.use_triton(torch.zeros(1))
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert not dispatch.use_triton(torch.zeros(1))
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError):
        dispatch.use_triton(torch.zeros(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_cuda_tensors_use_triton(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.use_triton(torch.zeros(1, device="cuda"))


@pytest.mark.parametrize("choice", ["torch", "triton"])
def test_both_paths_agree_through_the_dispatchers(choice, monkeypatch, device, generator):
    monkeypatch.setenv(dispatch.ENV_VAR, choice)
    seeds = torch.randint(0, 2**62, (6,), generator=generator).to(device)
    positions = torch.arange(6, device=device) + 1000
    u = dispatch.counter_uniform(seeds, positions, STREAM_SAMPLE)
    assert torch.equal(u.cpu(), counter_uniform_torch(seeds.cpu(), positions.cpu(), STREAM_SAMPLE))
    probs = torch.rand(6, 50, generator=generator).to(device)
    assert torch.equal(dispatch.sample_from_probs(probs, u).cpu(), sample_from_probs_torch(probs.cpu(), u.cpu()))
