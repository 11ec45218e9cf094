"""CUDA graphs of whole step programs: one replay per worker call.

Eager, a 7B forward spends 20-40 ms of host time launching ~400 kernels for ~5 ms of GPU work at batch 1, and a
draft call of k steps plus sampling launches k times as many. A captured graph launches them all in one call. One
graph per program shape (program, batch bucket, tokens per sequence, k, sampling mode, context class), captured on
first use, all in one memory pool. The host writes a call's packed inputs (runtime/step_inputs.py) into a
page-locked buffer; the graph itself copies them to the device, runs the program and copies its packed result back
into another page-locked buffer, so a call is one graph launch and one wait: every CUDA call costs host time (tens
of microseconds each under a virtualised GPU), and a call used to make half a dozen. A batch smaller than its bucket
is padded with dummy sequences whose KV goes to a scratch block.
"""

import gc
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from specsplit.services.runtime.pending_step import PendingStep

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_for(num_seqs: int) -> int | None:
    return next((b for b in BATCH_BUCKETS if b >= num_seqs), None)


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    staging: torch.Tensor        # page-locked host buffer the host fills; copied to `inputs`
    inputs: torch.Tensor         # the device buffer the program reads
    output: torch.Tensor         # the device tensor the program writes; copied to `result`
    result: torch.Tensor         # page-locked host buffer
    copies_inside: bool          # the two copies are part of the graph (else launched around each replay)
    pending: PendingStep | None = None  # a launch whose result no one has read yet: read before the next replay


def page_locked(shape, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor in page-locked memory registered with the CUDA driver rather than taken from torch's pinned
    allocator, whose bookkeeping (an event per copy) cannot be captured in a graph; unregistered when freed."""
    tensor = torch.empty(shape, dtype=dtype)
    cudart = torch.cuda.cudart()
    size = tensor.numel() * tensor.element_size()
    if size:
        cudart.cudaHostRegister(tensor.data_ptr(), size, 0)
        weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())
    return tensor


class GraphCache:
    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_stream = torch.cuda.Stream(device)
        self.steps: dict[tuple, CapturedStep] = {}
        self.copies_inside = True

    def clear(self) -> None:
        """Drop every graph. Later captures go to a new memory pool: capturing into the old one while the dropped
        graphs' memory is still being released trips the caching allocator's assertion."""
        if self.steps:  # a replay may still run (a tensor-parallel follower does not wait for its replays)
            torch.cuda.synchronize(self.device)
        self.steps.clear()
        gc.collect()
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, key: tuple, program, host_inputs: np.ndarray, wait: bool = True) -> np.ndarray | None:
        """Replay the graph of `key` (capturing it on first use) on `host_inputs`; returns the result on the host
        (valid until the next call). `program(inputs)` maps a device int64 buffer of the layout `host_inputs` has
        to one device tensor. `wait` False: return None at once, without the result (a tensor-parallel rank that
        does not decide: its next call cannot come before rank 0 has this one's result, which needs this rank's
        replay to have reached its last collective, long after it read its inputs)."""
        step = self._replay(key, program, host_inputs, copy_back=wait)
        if not wait:
            return None
        torch.cuda.current_stream(self.device).synchronize()
        return step.result.numpy()

    def launch(self, key: tuple, program, host_inputs: np.ndarray) -> PendingStep:
        """Like `run`, without waiting: the result is read from the returned PendingStep (a later replay of this key
        first waits for it and keeps its result, since a replay overwrites the graph's host buffers)."""
        step = self._replay(key, program, host_inputs, copy_back=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        step.pending = PendingStep(step.result, event)
        return step.pending

    def _replay(self, key: tuple, program, host_inputs: np.ndarray, copy_back: bool) -> CapturedStep:
        """Queue the graph's replay on `host_inputs` and, with `copy_back`, its result's copy to the host."""
        step = self.steps.get(key) or self._capture(key, program, host_inputs)
        if step.pending is not None:  # a launch still owns the buffers: it ends, and its result is kept, first
            step.pending.result()
            step.pending = None
        step.staging.numpy()[:] = host_inputs
        with torch.cuda.device(self.device):  # a graph replays on its own device's current stream
            if not step.copies_inside:
                step.inputs.copy_(step.staging, non_blocking=True)
            step.graph.replay()
            if copy_back and not step.copies_inside:
                step.result.copy_(step.output, non_blocking=True)
        return step

    def _capture(self, key: tuple, program, host_inputs: np.ndarray) -> CapturedStep:
        with torch.cuda.device(self.device):  # capture runs on the current device's streams: make it this one
            staging = page_locked(host_inputs.shape, torch.int64)
            staging.numpy()[:] = host_inputs
            inputs = torch.empty(host_inputs.shape, dtype=torch.int64, device=self.device)
            # Warm up outside the capture (compiles the Triton kernels, settles cuBLAS workspaces).
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), torch.inference_mode():
                inputs.copy_(staging, non_blocking=True)
                warm = program(inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            result = page_locked(warm.shape, warm.dtype)
            del warm
            try:
                graph, output = self._record(program, staging, inputs, result, copies_inside=self.copies_inside)
            except RuntimeError:
                if not self.copies_inside:
                    raise
                self.copies_inside = False  # this build cannot capture the copies: launch them around replays
                graph, output = self._record(program, staging, inputs, result, copies_inside=False)
        step = CapturedStep(graph, staging, inputs, output, result, self.copies_inside)
        self.steps[key] = step
        return step

    def _record(self, program, staging, inputs, result, copies_inside: bool):
        graph = torch.cuda.CUDAGraph()
        # An explicit capture stream on this device: torch's default one is made once, on whichever device was
        # current at the first capture in the process. No garbage collection while capturing: freeing another
        # graph (say, of a runner that was dropped) is not permitted then and would invalidate this capture.
        gc.collect()
        gc.disable()
        try:
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                if copies_inside:
                    inputs.copy_(staging, non_blocking=True)
                output = program(inputs)
                if copies_inside:
                    result.copy_(output, non_blocking=True)
        finally:
            gc.enable()
        return graph, output
