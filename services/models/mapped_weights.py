"""A float32 checkpoint's tensors as read-only views of its files, mapped into memory: the dense half of a target's
dual layout (weight_formats.py) without a second copy in the process's own memory.

A speculating CPU target holds its weights packed (oneDNN's layout, fastest for the k+1 rows it verifies), but its
one-row steps, which it runs whenever the speculation policy finds the draft does not pay, are faster dense on some
CPUs. The dense weights are already on disk in the model folder, and the page cache holds them after loading: mapped,
they cost no anonymous memory (the kernel may drop their pages under pressure and read them back on the next
one-row step). The loader fuses q/k/v and gate/up into single matmuls; the file keeps them apart, so a fused layer's
dense weight is the list of its parts, in fusion order (`dense_parts`).

Only safetensors files whose tensors are float32 and little-endian (this machine's order) are mapped: anything else
(a GGUF, a bf16 checkpoint, random weights) gives no parts, and the dual layout then copies.
"""

import json
import mmap
import struct
import sys
import warnings
from pathlib import Path

import torch

# Checkpoint tensor names of a loaded module's weight, in the order the loader fuses them (decoder.load_hf_state_dict).
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class MappedCheckpoint:
    """The float32 tensors of a folder's safetensors files, each a view of a read-only mapping of its file."""

    def __init__(self, folder: str | Path):
        self._maps: list[mmap.mmap] = []
        self._where: dict[str, tuple[mmap.mmap, int, list[int]]] = {}
        if sys.byteorder != "little":
            return
        for path in sorted(Path(folder).glob("*.safetensors")):
            with open(path, "rb") as f:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            header_size = struct.unpack("<Q", mapping[:8])[0]
            header = json.loads(mapping[8:8 + header_size])
            self._maps.append(mapping)
            for name, entry in header.items():
                if name != "__metadata__" and entry["dtype"] == "F32":
                    start, _ = entry["data_offsets"]
                    self._where[name] = (mapping, 8 + header_size + start, entry["shape"])

    def tensor(self, name: str) -> torch.Tensor | None:
        """The named float32 tensor as a view of the mapped file (not writable), or None if the files lack it."""
        if name not in self._where:
            return None
        mapping, offset, shape = self._where[name]
        count = 1
        for size in shape:
            count *= size
        with warnings.catch_warnings():  # frombuffer warns that the buffer is read-only: nothing writes weights
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mapping, dtype=torch.float32, count=count, offset=offset)
        return flat.view(shape)

    def dense_parts(self, module_name: str, weight: torch.Tensor) -> list[torch.Tensor] | None:
        """The mapped tensors whose rows, stacked, equal `weight` of the linear layer at `module_name` (a fused
        layer's in fusion order), or None where the files do not hold them as float32 of the right shapes."""
        prefix, _, leaf = module_name.rpartition(".")
        names = [f"{prefix}.{part}.weight" if prefix else f"{part}.weight" for part in FUSED_PARTS.get(leaf, (leaf,))]
        parts = [self.tensor(name) for name in names]
        if any(p is None for p in parts) or sum(p.shape[0] for p in parts) != weight.shape[0]:
            return None
        if any(p.dim() != 2 or p.shape[1] != weight.shape[1] for p in parts):
            return None
        first_rows = torch.cumsum(torch.tensor([0] + [p.shape[0] for p in parts[:-1]]), 0).tolist()
        if not all(torch.equal(p[0], weight[row]) for p, row in zip(parts, first_rows)):  # another file's weights
            return None
        return parts

    def __len__(self) -> int:
        return len(self._where)
