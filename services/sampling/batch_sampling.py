"""Per-row sampling settings gathered into tensors, so one call processes rows of many requests."""

import torch

from specsplit.services.runtime.worker_sequences import WorkerSampling


def sampling_tensors(rows: list[WorkerSampling], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> temperature [N] f32, top_k [N] i64, top_p [N] f32, seeds [N] i64."""
    return (
        torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device),
        torch.tensor([r.top_k for r in rows], dtype=torch.int64, device=device),
        torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device),
        torch.tensor([r.seed for r in rows], dtype=torch.int64, device=device),
    )
