"""Counter-based uniforms: the Triton device function is bit-identical to the torch reference."""

import pytest
import torch

from specsplit.kernels.counter_rng import (STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE, bits_to_uniform,
                                           counter_uniform_torch)
from specsplit.kernels.counter_rng_triton import counter_uniform_triton


def _seeds_and_positions(n, generator):
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), dtype=torch.int64, generator=generator)
    seeds[:4] = torch.tensor([0, -1, 2**63 - 1, -2**63])
    positions = torch.randint(0, 2**40, (n,), dtype=torch.int64, generator=generator)
    positions[:4] = torch.tensor([0, 2**30 - 1, 2**30, 123456789012])
    return seeds, positions


@pytest.mark.parametrize("stream", [STREAM_DRAFT, STREAM_ACCEPT, STREAM_SAMPLE])
def test_triton_is_bit_identical_to_torch(stream, device, generator):
    seeds, positions = _seeds_and_positions(3000, generator)
    want = counter_uniform_torch(seeds, positions, stream)
    got = counter_uniform_triton(seeds.to(device), positions.to(device), stream).cpu()
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_triton_broadcasts_like_torch(device, generator):
    seeds = torch.randint(0, 2**62, (5, 1), generator=generator)
    positions = torch.arange(7)
    want = counter_uniform_torch(seeds, positions, STREAM_SAMPLE)
    got = counter_uniform_triton(seeds.to(device), positions.to(device), STREAM_SAMPLE).cpu()
    assert got.shape == (5, 7)
    assert torch.equal(got, want)


def test_uniforms_stay_inside_the_open_interval():
    extremes = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 1], dtype=torch.int64)
    u = bits_to_uniform(extremes)
    assert (u > 0).all() and (u < 1).all()
    assert u[0] == 2.0**-24 and u[-1] == 1 - 2.0**-24
    # Every value is its bucket's exact centre (no float32 rounding).
    assert torch.equal((u.double() * 2**23 - 0.5), (extremes >> 9).double())


def test_reference_is_uniform_and_streams_are_independent(generator):
    seed = torch.randint(0, 2**62, (1,), generator=generator)
    positions = torch.arange(200_000)
    draft = counter_uniform_torch(seed, positions, STREAM_DRAFT)
    accept = counter_uniform_torch(seed, positions, STREAM_ACCEPT)
    # Mean, variance and a 20-bin histogram of a uniform; streams uncorrelated.
    assert abs(float(draft.mean()) - 0.5) < 0.005
    assert abs(float(draft.var()) - 1 / 12) < 0.002
    counts = torch.histc(draft, bins=20, min=0, max=1)
    assert float(((counts - 10_000) ** 2 / 10_000).sum()) < 45.3  # chi-square, 19 dof, p = 0.001
    assert abs(float(torch.corrcoef(torch.stack([draft, accept]))[0, 1])) < 0.01


def test_the_scalar_uniform_is_the_tensor_one(generator):
    from specsplit.kernels.counter_rng import counter_uniform_scalar

    seeds = torch.randint(0, 2**62, (50,), generator=generator)
    positions = torch.randint(0, 2**31, (50,), generator=generator)
    for stream in range(4):
        want = counter_uniform_torch(seeds, positions, stream).tolist()
        assert [counter_uniform_scalar(int(s), int(p), stream) for s, p in zip(seeds, positions)] == want
