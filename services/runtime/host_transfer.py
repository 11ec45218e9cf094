"""Host <-> device copies that do not stall the GPU queue.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory and waits for the whole stream, so the
host stops queueing work until the GPU has caught up. Staging through pinned memory with `non_blocking=True` keeps
the copy in stream order without that wait. The other way, several results come back with one wait instead of one
per tensor. On the CPU both are plain tensor operations.
"""

import torch


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list (or nested list) as a tensor on `device`, without a stream-wide wait on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copy device tensors to the CPU with a single wait for all of them."""
    if not any(t.is_cuda for t in tensors):
        return tensors
    copies = tuple(t.to("cpu", non_blocking=True) if t.is_cuda else t for t in tensors)
    torch.cuda.current_stream(next(t.device for t in tensors if t.is_cuda)).synchronize()
    return copies
