"""The temperature / top-k / top-p filter (services/sampling/logits_processing.py) against references that do not use
it (sampling_reference.py): transformers' warpers on rows without ties, the rules written out on rows with them, in
mixed batches where every row has its own settings, on the CPU and on a GPU."""

import pytest
import torch

from sampling_reference import defined_probs, warped_probs
from specsplit.services.sampling.logits_processing import SamplingFlags, processed_probs

VOCAB = 1000
# (temperature, top_k, top_p); 0 = greedy, top_k 0 and top_p 1 = off
SETTINGS = [(1.0, 0, 1.0), (0.7, 50, 1.0), (1.3, 0, 0.9), (0.9, 20, 0.8), (0.5, 5, 0.5), (2.0, 900, 0.99),
            (1.0, 1, 1.0), (0.8, 0, 0.05), (0.0, 0, 1.0), (1.1, 300, 0.3)]


def mixed_batch(logits: torch.Tensor, settings: list[tuple]) -> torch.Tensor:
    """Row i with settings[i % len(settings)], the whole batch in one call (as the step programs make it)."""
    rows = [settings[i % len(settings)] for i in range(logits.shape[0])]
    return processed_probs(logits, torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]),
                           torch.tensor([r[2] for r in rows]))


def rounded_logits(rows: int, generator: torch.Generator, vocab: int = VOCAB) -> torch.Tensor:
    """Logits on a coarse grid (as bf16 makes them): every row has many ties, at any k and any top-p cut."""
    return ((torch.randn(rows, vocab, generator=generator) * 2).round(decimals=1)).float()


def test_the_filter_matches_transformers_on_rows_without_ties():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(330, VOCAB, generator=generator) * (1 + 5 * torch.rand(330, 1, generator=generator))
    logits = logits[[row.unique().numel() == VOCAB for row in logits]][:300]  # float32 normals tie now and then
    assert logits.shape[0] == 300
    got = mixed_batch(logits, SETTINGS)
    for s, setting in enumerate(SETTINGS):
        rows = torch.arange(s, logits.shape[0], len(SETTINGS))
        want = warped_probs(logits[rows], *setting)
        assert torch.equal(got[rows] > 0, want > 0), setting  # the same tokens kept, row by row
        assert (got[rows] - want).abs().max() < 1e-6, setting
    # top_p = 1 (beside rows that use top-p) keeps every token, however small: no mass lost to rounding.
    assert (got[torch.arange(0, 300, len(SETTINGS))] > 0).all()


def test_every_token_tied_with_the_kth_is_kept():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0, 2.0]])
    probs = processed_probs(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))[0]
    assert (probs > 0).tolist() == [False, True, True, True, False, True]
    e = torch.tensor([3.0, 2.0]).exp()
    total = e[0] + 3 * e[1]
    assert torch.allclose(probs[[1, 2, 3, 5]], torch.stack([e[0], e[1], e[1], e[1]]) / total)
    assert probs.tolist() == pytest.approx(defined_probs(logits[0].tolist(), 1.0, top_k=2))
    # transformers keeps them too.
    assert torch.equal(probs > 0, warped_probs(logits, 1.0, top_k=2)[0] > 0)


@pytest.mark.parametrize("probs, top_p, kept", [
    # 0.4 alone is short of 0.5; the first 0.2 reaches it; the other 0.2, tied with it, stays too.
    ([0.1, 0.2, 0.4, 0.1, 0.2], 0.5, [0.0, 0.25, 0.5, 0.0, 0.25]),
    # The most likely tokens tie: one already covers top_p, all three stay.
    ([0.3, 0.1, 0.3, 0.3], 0.2, [1 / 3, 0.0, 1 / 3, 1 / 3]),
    # No tie at the cut: the smallest prefix reaching top_p.
    ([0.1, 0.2, 0.4, 0.1, 0.2], 0.3, [0.0, 0.0, 1.0, 0.0, 0.0]),
    ([0.05, 0.25, 0.4, 0.1, 0.2], 0.8, [0.0, 0.25 / 0.85, 0.4 / 0.85, 0.0, 0.2 / 0.85]),
])
def test_every_token_tied_with_the_last_one_top_p_needs_is_kept(probs, top_p, kept):
    logits = torch.tensor(probs).log()[None, :]
    got = processed_probs(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([top_p]))[0]
    assert got.tolist() == pytest.approx(kept, abs=1e-6)
    assert got.tolist() == pytest.approx(defined_probs(logits[0].tolist(), 1.0, top_p=top_p), abs=1e-6)


def test_rows_with_ties_follow_the_definitions():
    """Which of several tied tokens survive must not depend on a sort: all of them do. transformers' top-p keeps
    a subset of them, so its support is contained in ours and differs only by tokens tied at the cut."""
    generator = torch.Generator().manual_seed(1)
    logits = rounded_logits(100, generator)
    got = mixed_batch(logits, SETTINGS)
    ties_at_a_cut = 0
    for i, row in enumerate(logits):
        setting = SETTINGS[i % len(SETTINGS)]
        want = torch.tensor(defined_probs(row.tolist(), *setting))
        assert torch.equal(got[i] > 0, want > 0), (i, setting)
        assert (got[i].double() - want).abs().max() < 1e-6, (i, setting)
        theirs = warped_probs(row[None, :], *setting)[0] > 0
        ours = got[i] > 0
        assert not (theirs & ~ours).any()
        if setting[0] > 0 and (ours & ~theirs).any():  # only tokens tied with the smallest logit both keep
            ties_at_a_cut += 1
            assert (row[ours & ~theirs] == row[theirs].min()).all()
    assert ties_at_a_cut > 0  # the rows do exercise ties at the cut


def test_the_filter_does_not_depend_on_the_order_of_tied_tokens():
    generator = torch.Generator().manual_seed(2)
    logits = rounded_logits(60, generator)
    probs = mixed_batch(logits, SETTINGS)
    for seed in range(3):
        order = torch.randperm(VOCAB, generator=generator)
        permuted = mixed_batch(logits[:, order], SETTINGS)
        sampled = torch.tensor([s[0] > 0 for s in SETTINGS]).repeat(6)  # greedy takes the first of tied maxima
        assert torch.equal(permuted[sampled] > 0, probs[sampled][:, order] > 0), seed
        assert (permuted[sampled] - probs[sampled][:, order]).abs().max() < 1e-6  # softmax sums in another order


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_keeps_every_tied_token_as_the_cpu_does():
    """bf16 logits of a real vocabulary's size, where ties are everywhere; the GPU sorts them differently. Every
    sampled row keeps an upper set of its logits (a token kept, every token at or above it kept), and rows whose cut
    needs no sum (top-k, greedy, no filter) keep exactly the CPU's tokens; top-p cuts are sums whose last bits differ
    between devices, so there the two distributions agree to within rounding. With the flags given (as in a
    captured step program) and read from the tensors."""
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 151_936, generator=generator) * 3).bfloat16().float()
    rows = [SETTINGS[i % len(SETTINGS)] for i in range(64)]
    settings = [torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]), torch.tensor([r[2] for r in rows])]
    sampled = torch.tensor([r[0] > 0 for r in rows])
    summed = torch.tensor([r[2] < 1.0 for r in rows])
    want = processed_probs(logits, *settings)
    for flags in (SamplingFlags(top_k=True, top_p=True, greedy=True), None):
        got = processed_probs(logits.cuda(), *[s.cuda() for s in settings], flags).cpu()
        kept = got > 0
        smallest_kept = logits.masked_fill(~kept, float("inf")).amin(dim=-1, keepdim=True)
        assert torch.equal(kept[sampled], (logits >= smallest_kept)[sampled])
        assert torch.equal(kept[~summed], want[~summed] > 0)
        assert (got[~summed] - want[~summed]).abs().max() < 1e-6
        assert ((got[summed] - want[summed]).abs().sum(dim=-1) < 1e-3).all()  # total variation
