"""The draft's proposal distribution q: the request's processed distribution truncated to its top-K tokens.

Sending only q's support (token ids and their probabilities) is exact — the verifier needs q, not the draft's
full distribution — and keeps a proposal to kilobytes. Greedy requests have K = 1.
"""

import torch

from specsplit.kernels.dispatch import sample_from_probs, sum_rows, top_k_rows


def sparse_draft_distribution(probs: torch.Tensor, support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [N, V] -> (token ids [N, K] int64, renormalised probs [N, K] float32), highest first."""
    support = min(support, probs.shape[-1])
    top_probs, top_ids = top_k_rows(probs, support)
    return top_ids, top_probs / sum_rows(top_probs)[:, None]


def sample_sparse(ids: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from a sparse distribution, by inverse CDF with the given uniforms. -> [N] int64."""
    index = sample_from_probs(probs, uniforms)
    return ids.gather(1, index[:, None]).squeeze(1)
