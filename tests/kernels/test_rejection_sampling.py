"""Rejection sampling: the torch reference on hand-made greedy cases and in distribution; the Triton kernels
token-for-token against it."""

import pytest
import torch

from specsplit.kernels.rejection_sampling import rejection_sample_torch, sample_from_probs_torch
from specsplit.kernels.rejection_sampling_triton import rejection_sample_triton, sample_from_probs_triton


def _one_hot_rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()


def _cu(num_draft):
    return torch.tensor([0] + torch.tensor(num_draft).cumsum(0).tolist(), dtype=torch.int64)


def padded(num_draft, p, draft, q_ids, q_probs, accept_u, sample_u):
    """A batch written flat (sequence b's drafts at cu[b]:cu[b+1], its targets at cu[b]+b:cu[b+1]+b+1) in the
    padded layout the sampler takes: [num_seqs, max_k(+1), ...], padding rows filled with junk it must ignore."""
    num_seqs, max_k = len(num_draft), max(num_draft)
    cu = _cu(num_draft).tolist()
    support = q_ids.shape[1]
    out = (torch.rand(num_seqs, max_k + 1, p.shape[1]), torch.zeros(num_seqs, max_k, dtype=torch.int64),
           torch.zeros(num_seqs, max_k, support, dtype=torch.int64), torch.full((num_seqs, max_k, support), 0.5),
           torch.tensor(num_draft), torch.full((num_seqs, max_k), 0.5), torch.full((num_seqs, max_k + 1), 0.5))
    for b, k in enumerate(num_draft):
        out[0][b, : k + 1] = p[cu[b] + b : cu[b + 1] + b + 1]
        out[1][b, :k], out[2][b, :k], out[3][b, :k] = draft[cu[b]:cu[b + 1]], q_ids[cu[b]:cu[b + 1]], q_probs[cu[b]:cu[b + 1]]
        out[5][b, :k] = accept_u[cu[b]:cu[b + 1]]
        out[6][b, : k + 1] = sample_u[cu[b] + b : cu[b + 1] + b + 1]
    return out


def per_sequence_reference(num_draft, p, draft, q_ids, q_probs, accept_u, sample_u):
    """The rule written out one sequence at a time (flat layout), to check the batched reference against."""
    cu, rows = _cu(num_draft).tolist(), []
    for b, k in enumerate(num_draft):
        n_acc = 0
        while n_acc < k:
            i, t = cu[b] + n_acc, cu[b] + b + n_acc
            q_of_draft = float((q_probs[i] * (q_ids[i] == draft[i])).sum())
            if not float(accept_u[i]) * q_of_draft < float(p[t, draft[i]]):
                break
            n_acc += 1
        t = cu[b] + b + n_acc
        dist = p[t]
        if n_acc < k:
            q_dense = torch.zeros_like(dist).scatter_add_(0, q_ids[cu[b] + n_acc], q_probs[cu[b] + n_acc])
            residual = (dist - q_dense).clamp(min=0)
            dist = residual if float(residual.sum()) > 0 else dist
        token = int(sample_from_probs_torch(dist[None], sample_u[t : t + 1])[0])
        rows.append((draft[cu[b] : cu[b] + n_acc].tolist() + [token], n_acc))
    return rows


# ---- the reference -------------------------------------------------------------------------------------------

def test_reference_inverse_cdf_thresholds():
    # Exactly representable masses, so "reaches" is tested at equality.
    probs = torch.tensor([[0.25, 0.25, 0.5]] * 5 + [[0.0, 0.0, 2.0]])
    u = torch.tensor([0.125, 0.25, 0.3, 0.5, 0.75, 0.5])
    # First index whose cumulative mass reaches u * total (rows need not sum to one).
    assert sample_from_probs_torch(probs, u).tolist() == [0, 0, 1, 1, 2, 2]


def test_reference_greedy_from_hand_made_logits():
    # Vocabulary of 6; each target row's argmax written out by hand.
    target_logits = torch.tensor([
        # sequence 0: 3 drafts, the third one wrong
        [0.1, 3.0, 0.2, 0.0, 0.0, 0.0],   # argmax 1
        [0.0, 0.0, 0.0, 2.5, 0.1, 0.0],   # argmax 3
        [0.0, 0.0, 0.0, 0.0, 0.0, 4.0],   # argmax 5
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],   # (not reached)
        # sequence 1: 2 drafts, both right: bonus from the last row
        [0.0, 0.0, 5.0, 0.0, 0.0, 0.0],   # argmax 2
        [0.0, 0.0, 0.0, 0.0, 1.0, 0.0],   # argmax 4
        [0.0, 7.0, 0.0, 0.0, 0.0, 0.0],   # bonus: argmax 1
        # sequence 2: no drafts: plain greedy decode
        [0.0, 0.0, 0.0, 9.0, 0.0, 0.0],   # argmax 3
        # sequence 3: 1 draft, wrong
        [2.0, 0.0, 0.0, 0.0, 0.0, 0.0],   # argmax 0
        [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],   # (not reached)
    ])
    draft = torch.tensor([1, 3, 4, 2, 4, 5])
    # A greedy draft's q is one-hot at its token.
    q_ids, q_probs = draft[:, None].clone(), torch.ones(6, 1)
    p = _one_hot_rows(target_logits)
    for seed in range(3):  # greedy: the uniforms must not matter
        g = torch.Generator().manual_seed(seed)
        out, num_acc = rejection_sample_torch(*padded([3, 2, 0, 1], p, draft, q_ids, q_probs,
                                                      torch.rand(6, generator=g), torch.rand(10, generator=g)))
        assert num_acc.tolist() == [2, 2, 0, 0]
        assert out.tolist() == [[1, 3, 5, -1], [2, 4, 1, -1], [3, -1, -1, -1], [0, -1, -1, -1]]


def test_reference_output_is_distributed_as_the_target(generator):
    # One draft position: whatever q is, the first emitted token must follow p exactly.
    p_row = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15])
    q_ids = torch.tensor([3, 0, 2])
    q_row = torch.tensor([0.6, 0.3, 0.1])  # a bad draft: heavy where p is light
    n = 4000
    draft = q_ids[torch.multinomial(q_row, n, replacement=True, generator=generator)]
    out, _ = rejection_sample_torch(p_row.repeat(n, 2, 1), draft[:, None], q_ids.repeat(n, 1, 1),
                                    q_row.repeat(n, 1, 1), torch.ones(n, dtype=torch.int64),
                                    torch.rand(n, 1, generator=generator), torch.rand(n, 2, generator=generator))
    counts = torch.bincount(out[:, 0], minlength=5).double()
    expected = p_row.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5  # 4 degrees of freedom, p = 0.001


def test_reference_equals_the_rule_applied_one_sequence_at_a_time(generator):
    num_draft = [3, 0, 5, 1, 4, 2]
    p, draft, q_ids, q_probs, _ = _speculative_batch(num_draft, 120, 8, generator, 0.7)
    seen = set()
    for _ in range(4):
        accept_u, sample_u = torch.rand(len(draft), generator=generator), torch.rand(len(p), generator=generator)
        out, num_acc = rejection_sample_torch(*padded(num_draft, p, draft, q_ids, q_probs, accept_u, sample_u))
        want = per_sequence_reference(num_draft, p, draft, q_ids, q_probs, accept_u, sample_u)
        assert num_acc.tolist() == [n for _, n in want]
        assert [row[: n + 1].tolist() for row, (_, n) in zip(out, want)] == [tokens for tokens, _ in want]
        assert all((row[n + 1 :] == -1).all() for row, (_, n) in zip(out, want))
        seen.update(num_acc.tolist())
    assert len(seen) >= 3


# ---- Triton against the reference ----------------------------------------------------------------------------

def _speculative_batch(num_draft, vocab, support, generator, mix=0.6):
    """Drafts sampled from sparse q; p leans towards q (mix) so that runs of acceptances happen."""
    total, num_seqs = sum(num_draft), len(num_draft)
    q_ids = torch.stack([torch.randperm(vocab, generator=generator)[:support] for _ in range(total)])
    q_probs = torch.rand(total, support, generator=generator) ** 2
    q_probs[:, -2:] = 0.0           # padding entries of the support
    q_ids[:, -1] = 0
    q_probs /= q_probs.sum(1, keepdim=True)
    draft = q_ids.gather(1, torch.multinomial(q_probs, 1, generator=generator)).squeeze(1)
    p = torch.softmax(torch.randn(total + num_seqs, vocab, generator=generator) * 2, -1)
    cu = _cu(num_draft)
    for b in range(num_seqs):
        for i in range(num_draft[b]):
            row, target_row = int(cu[b]) + i, int(cu[b]) + b + i
            q_dense = torch.zeros(vocab).scatter_add_(0, q_ids[row], q_probs[row])
            p[target_row] = mix * q_dense + (1 - mix) * p[target_row]
    return p, draft, q_ids, q_probs, cu


def _compare(p, draft, q_ids, q_probs, cu, accept_u, sample_u, device, **knobs):
    num_draft = (cu[1:] - cu[:-1]).tolist()
    batch = padded(num_draft, p, draft, q_ids, q_probs, accept_u, sample_u)
    want = rejection_sample_torch(*batch)
    num_seqs, width = want[0].shape
    poisoned = (torch.full((num_seqs, width), -7, dtype=torch.int64, device=device),
                torch.full((num_seqs,), -7, dtype=torch.int64, device=device))
    on = [t.to(device) for t in batch]
    got = rejection_sample_triton(*on, out=poisoned, **knobs)
    assert got[0] is poisoned[0] and got[1] is poisoned[1]
    assert torch.equal(got[0].cpu(), want[0]), (got[0], want[0])
    assert torch.equal(got[1].cpu(), want[1])
    return want


@pytest.mark.parametrize("mix", [0.9, 0.5])
def test_triton_matches_reference_token_for_token(mix, device, generator):
    num_draft = [3, 0, 5, 1, 4, 2]
    p, draft, q_ids, q_probs, cu = _speculative_batch(num_draft, 300, 8, generator, mix)
    # Several sets of uniforms over the same batch: rejections land at different positions.
    outcomes = set()
    for _ in range(3):
        accept_u, sample_u = torch.rand(len(draft), generator=generator), torch.rand(len(p), generator=generator)
        _, num_acc = _compare(p, draft, q_ids, q_probs, cu, accept_u, sample_u, device, block_v=64)
        outcomes.update(num_acc.tolist())
    assert len(outcomes) >= 3  # the test saw rejections early, late and not at all


def test_triton_greedy_matches_reference(device, generator):
    num_draft = [4, 2, 0, 3]
    vocab = 150
    logits = torch.randn(sum(num_draft) + 4, vocab, generator=generator)
    p = _one_hot_rows(logits)
    cu = _cu(num_draft)
    # Drafts right at some positions, wrong at others.
    target_rows = torch.cat([torch.arange(int(cu[b]), int(cu[b + 1])) + b for b in range(4)])
    draft = logits.argmax(-1)[target_rows]
    draft[[2, 5]] = (draft[[2, 5]] + 1) % vocab
    q_ids, q_probs = draft[:, None].clone(), torch.ones(len(draft), 1)
    _, num_acc = _compare(p, draft, q_ids, q_probs, cu, torch.rand(len(draft), generator=generator),
                          torch.rand(len(p), generator=generator), device, block_v=32)
    assert num_acc.tolist() == [2, 1, 0, 3]


def test_triton_falls_back_to_p_when_the_residual_is_empty(device, generator):
    # p <= q everywhere (p is q scaled down, as round-off can leave it): a rejection leaves max(p - q, 0) = 0, and
    # the recovered token is drawn from p itself, as in the reference.
    vocab, support = 100, 6
    q_ids = torch.randperm(vocab, generator=generator)[:support][None, :]
    q_probs = torch.softmax(torch.randn(1, support, generator=generator), -1)
    p = torch.zeros(2, vocab)
    p[0].scatter_(0, q_ids[0], q_probs[0] * 0.5)
    p[1] = 1.0 / vocab
    draft = q_ids[:, 0]
    accept_u = torch.tensor([0.9])  # 0.9 q > 0.5 q: rejected
    want, _ = _compare(p, draft, q_ids, q_probs, torch.tensor([0, 1]), accept_u, torch.rand(2, generator=generator),
                       device, block_v=32)
    assert want[0, 0] in q_ids[0].tolist()


def test_triton_inverse_cdf_thresholds_at_equality(device):
    # "Reaches" means >=: u * total landing exactly on a cumulative mass picks that index, not the next.
    probs = torch.tensor([[0.25, 0.25, 0.5]] * 5 + [[0.0, 0.0, 2.0]], device=device)
    u = torch.tensor([0.125, 0.25, 0.3, 0.5, 0.75, 0.5], device=device)
    assert sample_from_probs_triton(probs, u).tolist() == [0, 0, 1, 1, 2, 2]


def test_triton_sample_from_probs_matches_reference(device, generator):
    vocab = 333  # not a multiple of the block
    probs = torch.rand(8, vocab, generator=generator) ** 3
    probs[1] = 0.0
    probs[1, 200] = 1.0                          # one-hot
    probs[2] = 0.0                               # no mass: index 0, like searchsorted
    probs[3, 50:] = 0.0                          # mass only at the start, a zero tail
    probs[4] *= 1e-30                            # tiny mass, unnormalised
    u = torch.rand(8, generator=generator)
    u[5], u[6] = 2.0**-24, 1 - 2.0**-24         # the extreme uniforms the counter RNG can give
    want = sample_from_probs_torch(probs, u)
    out = torch.full((8,), -7, dtype=torch.int64, device=device)
    got = sample_from_probs_triton(probs.to(device), u.to(device), block_v=64, out=out)
    assert got is out
    assert torch.equal(got.cpu(), want)
