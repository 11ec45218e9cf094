"""The fused all-reduce + residual add + RMSNorm kernel against its torch reference, and the reference against the
unfused arithmetic it replaces.

Without a GPU each rank's call runs in Triton's interpreter (which runs one kernel at a time) on its own
"symmetric" buffer and signal pad (CPU tensors whose addresses every rank is given), the other ranks' partials
already in their slots and their flags raised, as if they had reached the barrier first: each rank must end with
the reference's bits, its own partial in its slot for the others, the flags it waited on consumed and its signals
raised on every peer. Ranks meeting for real, concurrently over NVLink, is what the two-GPU bench checks
(bench/bench_gpu_tensor_parallel.py, part "exact").
"""

import importlib
import os
import sys

import pytest
import torch

from specsplit.kernels.all_reduce_rms_norm import all_reduce_add_rms_norm_torch
from specsplit.kernels.rms_norm import add_rms_norm_torch

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def kernel():
    """The kernel module, interpreted where there is no GPU (imported after conftest interpreted its helpers)."""
    name = "specsplit.kernels.all_reduce_rms_norm_triton"
    if HAS_CUDA:
        return importlib.import_module(name)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_sums_in_rank_order_then_adds_and_normalises(dtype, generator):
    partials = [torch.randn(3, 40, generator=generator).to(dtype) for _ in range(3)]
    residual = torch.randn(3, 40, generator=generator).to(dtype)
    weight = torch.randn(40, generator=generator).to(dtype)
    out, new_residual = all_reduce_add_rms_norm_torch(partials, residual, weight, 1e-6)
    total = (partials[0] + partials[1]) + partials[2]
    expected = add_rms_norm_torch(total, residual, weight, 1e-6)
    assert torch.equal(out, expected[0]) and torch.equal(new_residual, expected[1])


def _run_ranks(kernel, partials, residual, weight, slot, device):
    """Each rank's call in turn, on its own buffers, as if the other ranks had already reached the barrier: their
    partials are in their slots and their flags to this rank are raised. Returns each rank's (out, residual)."""
    world, (tokens, hidden) = len(partials), partials[0].shape
    programs = min(tokens, kernel.MAX_PROGRAMS)
    results = []
    for rank in range(world):
        buffers = [torch.full((2, tokens * hidden), float("nan"), dtype=partials[0].dtype, device=device)
                   for _ in range(world)]
        pads = [torch.zeros(kernel.MAX_PROGRAMS, world, dtype=torch.int32, device=device) for _ in range(world)]
        for peer in range(world):
            if peer != rank:
                buffers[peer][slot] = partials[peer].reshape(-1)
                pads[rank][:programs, peer] = 1  # the peer's programs have signalled this rank's
        slot_ptrs = torch.tensor([b[slot].data_ptr() for b in buffers], dtype=torch.int64, device=device)
        pad_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=device)
        results.append(kernel.all_reduce_add_rms_norm_triton(partials[rank], residual, weight, 1e-5, slot_ptrs,
                                                             pad_ptrs, rank, world))
        assert torch.equal(buffers[rank][slot], partials[rank].reshape(-1))  # its partial, for the peers to read
        assert torch.isnan(buffers[rank][1 - slot]).all()  # the other slot untouched
        assert int(pads[rank].abs().sum()) == 0  # every flag it waited on consumed: the next call starts clean
        for peer in range(world):  # and each peer's program p got this rank's signal, nothing else
            if peer != rank:
                signalled = torch.zeros(kernel.MAX_PROGRAMS, world, dtype=torch.int32, device=device)
                signalled[:programs, rank] = 1
                assert torch.equal(pads[peer], signalled)
    return results


@pytest.mark.parametrize("dtype, hidden, tokens, world", [(torch.float32, 48, 3, 2), (torch.bfloat16, 96, 20, 2),
                                                           (torch.float32, 100, 5, 4)])
def test_every_rank_gets_the_bits_of_the_sum_then_the_norm_kernel(kernel, dtype, hidden, tokens, world, device,
                                                                 generator):
    """Bit for bit what the unfused path computes (the ranks' sum, then kernels/rms_norm_triton.py), so switching a
    replica between all-reduce modes changes no token; and the torch reference within the norm's rounding. 20 rows
    over 16 programs: some programs take two rows; 4 ranks: flags of three peers per program."""
    from specsplit.kernels.rms_norm_triton import add_rms_norm_triton

    partials = [torch.randn(tokens, hidden, generator=generator).to(dtype=dtype, device=device) for _ in range(world)]
    residual = torch.randn(tokens, hidden, generator=generator).to(dtype=dtype, device=device)
    weight = torch.randn(hidden, generator=generator).to(dtype=dtype, device=device)
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    unfused = add_rms_norm_triton(total, residual, weight, 1e-5)
    reference = all_reduce_add_rms_norm_torch(partials, residual, weight, 1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the sum of squares may be taken in another order
    for out, new_residual in _run_ranks(kernel, partials, residual, weight, tokens % 2, device):
        assert torch.equal(new_residual, unfused[1]) and torch.equal(new_residual, reference[1])
        assert torch.equal(out, unfused[0])
        torch.testing.assert_close(out, reference[0], rtol=tolerance, atol=tolerance)


def test_a_bounded_barrier_gives_up_when_the_peers_never_come(kernel, device, generator):
    """What the setup check relies on to fail instead of hanging a GPU: with max_spins the wait for flags no peer
    raises ends; the rank's own signals were still sent."""
    x = torch.randn(2, 32, generator=generator).to(device)
    buffers = [torch.zeros(2, 64, device=device) for _ in range(2)]
    pads = [torch.zeros(kernel.MAX_PROGRAMS, 2, dtype=torch.int32, device=device) for _ in range(2)]
    slot_ptrs = torch.tensor([b[0].data_ptr() for b in buffers], dtype=torch.int64, device=device)
    pad_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=device)
    kernel.all_reduce_add_rms_norm_triton(x, None, torch.ones(32, device=device), 1e-6, slot_ptrs, pad_ptrs, 0, 2,
                                          max_spins=3)
    assert pads[1][:2, 0].tolist() == [1, 1] and int(pads[0].abs().sum()) == 0
