"""Typical acceptance (NOT lossless) over a target verifier's batch: each sequence's own parameters as per-proposal
tensors, and the merge with rejection-sampling verdicts when only some sequences of the batch opted in."""

from itertools import accumulate

import torch

from specsplit.kernels.dispatch import typical_accept
from specsplit.services.runtime.host_transfer import to_device
from specsplit.services.runtime.worker_sequences import WorkerSampling


def accept_typical(probs: torch.Tensor, draft_ids: torch.Tensor, num_draft: list[int],
                   samplings: list[WorkerSampling], sample_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's call: every sequence of the batch through typical acceptance with its own parameters.
    probs/sample_u: [sum(k + 1)] rows as the verifier lays them out; draft_ids [sum(k)]; num_draft per sequence."""
    device = probs.device
    # Sequences of a mixed batch that stay lossless have no parameters: any value will do, merge_typical drops them.
    thresholds = to_device([_or_zero(s.posterior_threshold) for s, k in zip(samplings, num_draft) for _ in range(k)],
                           torch.float32, device)
    alphas = to_device([_or_zero(s.posterior_alpha) for s, k in zip(samplings, num_draft) for _ in range(k)],
                       torch.float32, device)
    cu = to_device([0, *accumulate(num_draft)], torch.int64, device)
    return typical_accept(probs, draft_ids, cu, sample_u, thresholds, alphas, max(num_draft, default=0))


def merge_typical(typical: list[bool], typical_result, lossless_result) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the typical verdict where it asked for typical acceptance, else the lossless one."""
    (t_out, t_num), (r_out, r_num) = typical_result, lossless_result
    mask = to_device(typical, torch.bool, t_out.device)
    return torch.where(mask[:, None], t_out, r_out), torch.where(mask, t_num, r_num)


def _or_zero(value: float | None) -> float:
    return 0.0 if value is None else value
