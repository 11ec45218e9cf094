"""What the Triton kernels' launch choices read from the device they run on."""

import functools

import torch


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's SM count; 132 for the interpreter on the CPU (an H100's, so tests see the GPU's choices)."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132
