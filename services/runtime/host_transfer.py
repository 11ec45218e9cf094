"""Host <-> device copies that do not stall the GPU queue.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory and waits for the whole stream, so the
host stops queueing work until the GPU has caught up. Staging through pinned memory with `non_blocking=True` keeps
the copy in stream order without that wait. On the CPU it is a plain tensor. (The rounds' calls do not use it: their
inputs travel inside their graphs, runtime/cuda_graphs.py; prefills do.)
"""

import torch


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list (or nested list) as a tensor on `device`, without a stream-wide wait on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
