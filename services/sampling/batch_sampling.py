"""Per-row sampling settings gathered for a batch: the step programs' per-sequence fields and the processing flags."""

import numpy as np

from specsplit.services.runtime.worker_sequences import WorkerSampling
from specsplit.services.sampling.logits_processing import SamplingFlags


def sampling_fields(rows: list[WorkerSampling]) -> dict[str, np.ndarray]:
    """The settings as per-sequence step-program fields (runtime/step_inputs.py)."""
    return {
        "temperature": np.array([r.temperature for r in rows], dtype=np.float64),
        "top_k": np.array([r.top_k for r in rows], dtype=np.int64),
        "top_p": np.array([r.top_p for r in rows], dtype=np.float64),
        "seed": np.array([r.seed for r in rows], dtype=np.int64),
    }


def sampling_flags(rows: list[WorkerSampling], vocab_size: int, fewer_shapes: bool = False) -> SamplingFlags:
    """Which processing steps the batch needs, decided on the host (reading it back from the GPU would stall).
    `fewer_shapes` (graphs): a sampled batch always handles greedy rows, so mixed and all-sampled batches share a
    graph (the one-hot rows cost an argmax per row)."""
    return SamplingFlags(
        top_k=any(0 < r.top_k < vocab_size for r in rows),
        top_p=any(r.top_p < 1.0 for r in rows),
        greedy=any(r.temperature == 0 for r in rows) or fewer_shapes,
    )
