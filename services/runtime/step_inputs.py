"""A batched call's per-sequence inputs as one flat int64 buffer: one host-to-device copy per call.

A step program (the draft's k-step call, the target's verification) needs a handful of small per-sequence fields
(block-table row, lengths, tokens, sampling settings). Sending each as its own tensor costs a copy and a launch
apiece; here the host packs them, padded to the batch bucket, into one buffer whose layout is fixed by the
program's shape, and the device side takes views of it (float fields travel as float64 bit patterns and are cast
once). A captured graph reads the same layout from its static input buffer.
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Field:
    name: str
    width: int | None = None  # values per sequence: None = one ([rows]), else [rows, width]
    is_float: bool = False   # float32 on the device
    pad: float = 0           # value of padding rows (and of missing trailing values)


class StepLayout:
    def __init__(self, fields: tuple[Field, ...], rows: int):
        self.fields = fields
        self.rows = rows
        self.offsets = {}
        offset = 0
        for field in fields:
            self.offsets[field.name] = offset
            offset += rows * (field.width or 1)
        self.size = offset

    def pack(self, values: dict[str, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """values[name]: [num_seqs] or [num_seqs, width] (num_seqs <= rows; missing rows get the field's pad)."""
        out = np.empty(self.size, dtype=np.int64) if out is None else out
        for field in self.fields:
            start, width = self.offsets[field.name], field.width or 1
            block = out[start : start + self.rows * width].reshape(self.rows, width)
            given = np.asarray(values[field.name]).reshape(-1, width)
            if field.is_float:
                block = block.view(np.float64)
            block[: len(given)] = given
            block[len(given) :] = field.pad
        return out

    def unpack(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a device buffer packed by `pack` (float fields as float32 copies)."""
        out = {}
        for field in self.fields:
            start, width = self.offsets[field.name], field.width or 1
            block = buffer[start : start + self.rows * width].view(self.rows, width)
            if field.is_float:
                block = block.view(torch.float64).to(torch.float32)
            out[field.name] = block if field.width else block.squeeze(1)
        return out
