"""Typical acceptance (NOT lossless): the rule on hand-made distributions, the prefix and emitted-token semantics,
greedy rows reducing to rejection sampling's exact argmax match, determinism, and no host reads."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specsplit.kernels.rejection_sampling import rejection_sample_torch, sample_from_probs_torch
from specsplit.kernels.typical_acceptance import typical_accept_torch as typical_accept_padded, typical_bound
from specsplit.services.sampling.logits_processing import processed_probs


def padded(probs, drafts, cu, u, max_k):
    """A batch written flat (sequence b's drafts at cu[b]:cu[b+1], its target rows at cu[b]+b:cu[b+1]+b+1) in the
    padded layout the sampler takes; padding rows hold junk it must ignore."""
    num_draft = (cu[1:] - cu[:-1]).tolist()
    num_seqs, vocab = len(num_draft), probs.shape[1]
    p = torch.rand(num_seqs, max_k + 1, vocab)
    d = torch.zeros(num_seqs, max_k, dtype=torch.int64)
    uu = torch.full((num_seqs, max_k + 1), 0.5)
    starts = cu.tolist()
    for b, k in enumerate(num_draft):
        p[b, : k + 1] = probs[starts[b] + b : starts[b] + b + k + 1]
        d[b, :k] = drafts[starts[b] : starts[b] + k]
        uu[b, : k + 1] = u[starts[b] + b : starts[b] + b + k + 1]
    return p, d, torch.tensor(num_draft), uu


def typical_accept_torch(probs, drafts, cu, u, threshold, alpha, max_k):
    """The flat layout these tests were written in, through the padded sampler."""
    p, d, num_draft, uu = padded(probs, drafts, cu, u, max_k)
    return typical_accept_padded(p, d, num_draft, uu, threshold, alpha)


def rejection_flat(probs, drafts, q_ids, q_probs, cu, accept_u, sample_u, max_k):
    p, d, num_draft, uu = padded(probs, drafts, cu, sample_u, max_k)
    num_seqs, starts = len(num_draft), cu.tolist()
    qi = torch.zeros(num_seqs, max_k, q_ids.shape[1], dtype=torch.int64)
    qp = torch.zeros(num_seqs, max_k, q_ids.shape[1])
    au = torch.full((num_seqs, max_k), 0.5)
    for b, k in enumerate(num_draft.tolist()):
        qi[b, :k], qp[b, :k], au[b, :k] = (q_ids[starts[b] : starts[b] + k], q_probs[starts[b] : starts[b] + k],
                                           accept_u[starts[b] : starts[b] + k])
    return rejection_sample_torch(p, d, qi, qp, num_draft, au, uu)


def entropy64(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in p if x > 0)


def run_one(p_rows: list[list[float]], drafts: list[int], threshold=0.09, alpha=0.3, uniforms=None):
    """One sequence: k = len(drafts) proposals over k + 1 target rows."""
    probs = torch.tensor(p_rows, dtype=torch.float32)
    k = len(drafts)
    u = torch.full((k + 1,), 0.5) if uniforms is None else uniforms
    return typical_accept_torch(probs, torch.tensor(drafts, dtype=torch.int64), torch.tensor([0, k]), u, threshold, alpha, k)


def test_bound_is_min_of_threshold_and_scaled_exp_minus_entropy():
    torch.manual_seed(0)
    rows = torch.softmax(torch.randn(6, 50) * torch.tensor([0.1, 1.0, 3.0, 6.0, 12.0, 30.0])[:, None], dim=-1)
    rows[1, :10] = 0.0  # zeros (top-k/top-p removed tokens) count as 0 log 0 = 0
    rows[1] /= rows[1].sum()
    for threshold, alpha in [(0.09, 0.3), (0.5, 0.1), (0.0, 1.0), (0.99, 5.0)]:
        got = typical_bound(rows, threshold, alpha)
        for row, value in zip(rows.tolist(), got.tolist()):
            expected = min(threshold, alpha * math.exp(-entropy64(row)))
            assert value == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_hand_made_rows_accept_exactly_where_the_rule_says():
    peaked = [0.5, 0.3, 0.15, 0.05]  # H = 1.142, 0.3 * exp(-H) = 0.0957 > 0.09: the bound is the threshold 0.09
    assert min(0.09, 0.3 * math.exp(-entropy64(peaked))) == 0.09
    uniform = [0.01] * 100  # H = ln 100: the bound is 0.3 * 0.01 = 0.003, so a 1% token passes a 9% threshold
    for token, accepted in [(0, True), (1, True), (2, True), (3, False)]:
        output, n = run_one([peaked, peaked], [token])
        assert n.tolist() == [int(accepted)], token
    output, n = run_one([uniform, uniform], [37])
    assert n.tolist() == [1] and output[0, 0].item() == 37
    # With alpha 0 the bound is 0: anything the target gives any probability passes, a removed token (p = 0) never.
    zeroed = [0.6, 0.4, 0.0, 0.0]
    assert run_one([zeroed, zeroed], [1], alpha=0.0)[1].tolist() == [1]
    assert run_one([zeroed, zeroed], [2], alpha=0.0)[1].tolist() == [0]


def test_the_test_is_strict_at_the_bound():
    row = [0.25, 0.25, 0.25, 0.25]  # exp(-H) = 0.25; with alpha 10 the bound is the threshold itself
    assert run_one([row, row], [2], threshold=0.25, alpha=10.0)[1].tolist() == [0]  # 0.25 > 0.25 is false
    assert run_one([row, row], [2], threshold=0.2499, alpha=10.0)[1].tolist() == [1]
    # And the entropy side: the bound alpha * exp(-H) = 0.25 exactly with alpha = 1.
    assert run_one([row, row], [2], threshold=0.9, alpha=1.0)[1].tolist() == [0]
    assert run_one([row, row], [2], threshold=0.9, alpha=0.999)[1].tolist() == [1]


def test_prefix_ends_at_the_first_failure_and_emits_a_sample_of_p_there():
    # Three sequences with k = 3, 0 and 2. One-hot rows at distinct tokens tell which row a token was sampled from.
    vocab = 40
    row_token = [10, 11, 12, 13, 20, 30, 31, 32]
    probs = torch.nn.functional.one_hot(torch.tensor(row_token), vocab).float()
    # Sequence 0: d1 matches its row, d2 fails, d3 would match: accepted prefix 1, emits row 1's token (11).
    # Sequence 1: no proposals: emits its only row (20).  Sequence 2: both match: bonus from its last row (32).
    drafts = torch.tensor([10, 5, 12, 30, 31])
    cu = torch.tensor([0, 3, 3, 5])
    output, n = typical_accept_torch(probs, drafts, cu, torch.rand(8), 0.09, 0.3, 3)
    assert n.tolist() == [1, 0, 2]
    assert output.tolist() == [[10, 11, -1, -1], [20, -1, -1, -1], [30, 31, 32, -1]]


def test_emitted_token_is_the_target_only_sample_at_that_position():
    torch.manual_seed(3)
    num_seqs, k, vocab = 64, 4, 30
    probs = torch.softmax(torch.randn(num_seqs * (k + 1), vocab) * 2.5, dim=-1)
    drafts = torch.randint(0, vocab, (num_seqs * k,))
    cu = torch.arange(num_seqs + 1) * k
    u = torch.rand(num_seqs * (k + 1))
    output, n = typical_accept_torch(probs, drafts, cu, u, 0.09, 0.3, k)
    rows = torch.arange(num_seqs) * (k + 1) + n
    # The same inverse-CDF draw target-only decoding makes from p with that position's SAMPLE uniform.
    assert output[torch.arange(num_seqs), n].tolist() == sample_from_probs_torch(probs[rows], u[rows]).tolist()
    assert 0 < n.float().mean() < k  # a mix of early failures and full acceptance, so both cases were exercised


def test_greedy_rows_reduce_to_exact_argmax_match_like_rejection_sampling():
    torch.manual_seed(5)
    num_seqs, k, vocab = 200, 3, 25
    rows = num_seqs * (k + 1)
    logits = torch.randn(rows, vocab) * 3
    zero = torch.zeros(rows)
    probs = processed_probs(logits, zero, torch.zeros(rows, dtype=torch.int64), torch.ones(rows))  # one-hot rows
    argmax = logits.argmax(-1).view(num_seqs, k + 1)[:, :k].reshape(-1)
    # A greedy draft: its argmax guesses right 70% of the time; its q is one-hot at its token.
    drafts = torch.where(torch.rand(num_seqs * k) < 0.7, argmax, torch.randint(0, vocab, (num_seqs * k,)))
    cu = torch.arange(num_seqs + 1) * k
    u = torch.rand(rows)
    typical = typical_accept_torch(probs, drafts, cu, u, 0.09, 0.3, k)
    rejection = rejection_flat(probs, drafts, drafts[:, None], torch.ones(num_seqs * k, 1), cu,
                               torch.rand(num_seqs * k), u, k)
    assert torch.equal(typical[0], rejection[0]) and torch.equal(typical[1], rejection[1])
    for threshold, alpha in [(0.0, 0.0), (0.999, 100.0)]:  # any legal parameters
        assert torch.equal(typical_accept_torch(probs, drafts, cu, u, threshold, alpha, k)[0], rejection[0])


def test_per_sequence_parameters():
    row = [0.5, 0.3, 0.15, 0.05]
    probs = torch.tensor([row] * 4)
    # Two sequences of one proposal each (token 2, p = 0.15; exp(-H) = 0.319): the first with bound
    # min(0.2, 1.0 * 0.319) = 0.2 fails, the second with min(0.2, 0.3 * 0.319) = 0.096 passes.
    output, n = typical_accept_torch(probs, torch.tensor([2, 2]), torch.tensor([0, 1, 2]), torch.full((4,), 0.5),
                                     torch.tensor([0.2, 0.2]), torch.tensor([1.0, 0.3]), 1)
    assert n.tolist() == [0, 1]


def test_same_inputs_same_outputs_and_no_proposals_at_all():
    torch.manual_seed(9)
    probs = torch.softmax(torch.randn(13, 20), -1)
    drafts = torch.randint(0, 20, (9,))
    cu = torch.tensor([0, 4, 4, 9])
    u = torch.rand(13)
    first = typical_accept_torch(probs, drafts, cu, u, 0.09, 0.3, 5)
    assert all(torch.equal(a, b) for a, b in zip(first, typical_accept_torch(probs, drafts, cu, u, 0.09, 0.3, 5)))
    output, n = typical_accept_torch(probs[:3], drafts[:0], torch.zeros(4, dtype=torch.int64), u[:3], 0.09, 0.3, 0)
    assert n.tolist() == [0, 0, 0] and output[:, 0].tolist() == sample_from_probs_torch(probs[:3], u[:3]).tolist()


class HostReads(TorchDispatchMode):
    """Records the ATen ops that read device values on the host: `.item()`/`.tolist()` (_local_scalar_dense), and ops
    whose output shape depends on values (nonzero, masked_select, unique, repeat_interleave without output_size).
    On a GPU each is a sync, and none can be captured in a CUDA graph."""

    SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique", "aten.unique")

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(self.SYNCING) or (name.startswith("aten.repeat_interleave") and not (kwargs or {}).get("output_size")):
            self.found.append(name)
        return func(*args, **(kwargs or {}))


def test_no_host_reads():
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(11, 16), -1)
    drafts = torch.randint(0, 16, (8,))
    cu = torch.tensor([0, 3, 8])
    u = torch.rand(11)
    p, d, num_draft, uu = padded(probs, drafts, cu, u, 5)
    with HostReads() as reads:
        typical_accept_padded(p, d, num_draft, uu, torch.full((2,), 0.09), torch.full((2,), 0.3))
    assert reads.found == []
    with HostReads() as reads:  # the check sees them where they are
        probs.nonzero()
        probs[0, 0].item()
    assert "aten._local_scalar_dense.default" in reads.found and "aten.nonzero.default" in reads.found
