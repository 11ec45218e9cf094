"""CUDA graphs of whole step programs: one replay per worker call.

Eager, a 7B forward spends 20-40 ms of host time launching ~400 kernels for ~5 ms of GPU work at batch 1, and a
draft call of k steps plus sampling launches k times as many. A captured graph launches them all in one call. One
graph per program shape (program, batch bucket, tokens per sequence, k, sampling mode, context class), captured on
first use, all in one memory pool. Each graph reads its inputs from a static int64 buffer (runtime/step_inputs.py),
which the host fills with one copy from a pinned staging buffer, and leaves its packed result in a static output
tensor that comes back with one copy. A batch smaller than its bucket is padded with dummy sequences whose KV goes
to a scratch block.
"""

import gc
from dataclasses import dataclass

import numpy as np
import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_for(num_seqs: int) -> int | None:
    return next((b for b in BATCH_BUCKETS if b >= num_seqs), None)


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor         # static device buffer the graph reads
    staging: torch.Tensor        # pinned host buffer filled by the host, copied into `inputs`
    output: torch.Tensor         # static device result the graph writes
    result: torch.Tensor         # pinned host copy of `output`


class GraphCache:
    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_stream = torch.cuda.Stream(device)
        self.steps: dict[tuple, CapturedStep] = {}

    def clear(self) -> None:
        self.steps.clear()

    def run(self, key: tuple, program, host_inputs: np.ndarray) -> np.ndarray:
        """Replay the graph of `key` (capturing it on first use) on `host_inputs`; returns the result on the host.
        `program(inputs)` maps a device int64 buffer of the layout `host_inputs` has to one device tensor."""
        step = self.steps.get(key) or self._capture(key, program, host_inputs)
        step.staging.numpy()[:] = host_inputs
        with torch.cuda.device(self.device):  # a graph replays on its own device's current stream
            stream = torch.cuda.current_stream(self.device)
            step.inputs.copy_(step.staging, non_blocking=True)
            step.graph.replay()
            step.result.copy_(step.output, non_blocking=True)
            stream.synchronize()
        return step.result.numpy()

    def _capture(self, key: tuple, program, host_inputs: np.ndarray) -> CapturedStep:
        with torch.cuda.device(self.device):  # capture runs on the current device's streams: make it this one
            inputs = torch.from_numpy(host_inputs.copy()).to(self.device)
            # Warm up outside the capture (compiles the Triton kernels, settles cuBLAS workspaces).
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), torch.inference_mode():
                program(inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # An explicit capture stream on this device: torch's default one is made once, on whichever device was
            # current at the first capture in the process. No garbage collection while capturing: freeing another
            # graph (say, of a runner that was dropped) is not permitted then and would invalidate this capture.
            gc.collect()
            gc.disable()
            try:
                with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                    output = program(inputs)
            finally:
                gc.enable()
        step = CapturedStep(
            graph=graph,
            inputs=inputs,
            staging=torch.empty(inputs.shape, dtype=inputs.dtype, pin_memory=True),
            output=output,
            result=torch.empty(output.shape, dtype=output.dtype, pin_memory=True),
        )
        self.steps[key] = step
        return step
