"""How a model's linear layers hold their weights on the CPU, chosen per role.

- dense: torch's own layout. Often the fastest for one row at a time (target-only decoding at batch 1; which one is,
  depends on the CPU: layout_calibration.py measures it), and the only format off the CPU or outside float32.
- packed: float32 weights reordered once into oneDNN's blocked layout. A verification of k+1 rows, or a batched
  decode, then costs little more than one row, where the dense layout repacks the weight on every call and costs
  2-3x one row. Same float32 arithmetic; results differ from dense only in the last bits, as any two GEMM kernels'
  do. The target's default on the CPU.
- int8: weights quantized per output channel, activations per call (fbgemm): about half the draft's step time.
  Drafts only — it changes the draft's distributions, hence acceptance, but never the output: every token is
  verified against the target's own distribution. The draft's default on the CPU.
- bf16: weights held in bfloat16 and activations cast to it per call, float32 out. Drafts only, for the same reason
  as int8; fast only where the CPU multiplies bf16 natively (avx512_bf16, AMX), so calibration offers it there only.
- dual: both float32 layouts of every weight: dense for calls of up to DUAL_DENSE_ROWS rows, packed above. For a
  speculating target on a CPU where dense is fastest for one row and packed for a verification: its one-row steps
  (every round while the speculation policy finds the draft does not pay) run as fast as the target alone's, its
  verifications as fast as packed ones. The same float32 arithmetic as the layout each call uses. Where the model
  was loaded from float32 safetensors, the dense half is the file itself, mapped read-only (mapped_weights.py):
  no second copy in the process's memory, the page cache holds it. Otherwise it is a copy (6 GB for a float32 1.5B
  target), taken only when asked for (`--target-weights dual`); "auto" takes the mapped dual layout where its
  one-row half measures faster (layout_calibration.py).

"auto" picks the defaults above for float32 on the CPU and dense everywhere else; the services and the in-process
engine resolve "auto" by measurement instead (layout_calibration.py), falling back to these defaults.

The batch-invariant mode (kernels/dispatch.py) needs dense: its matmul is one fixed-order formulation over the
dense weight, where oneDNN's packed GEMM blocks by the row count and int8 quantizes activations per call (so one
row's result would depend on the others'). "auto" is then dense, and the other formats are refused.
"""

import os
import time
import warnings

import torch
from torch import nn

from specsplit.kernels.dispatch import batch_invariant
from specsplit.services.errors import InvalidArgument

WEIGHT_FORMATS = ("auto", "dense", "packed", "dual", "int8", "bf16")
# Formats that change the model's arithmetic beyond the last bits: never for a target (its outputs are the output).
DRAFT_ONLY_FORMATS = ("int8", "bf16")

# oneDNN picks its blocking for an expected row count; 5 = a k=4 verification. On the developer CPU
# (bench/bench_cpu_weight_formats.py --matrix) 2-64 rows run within ~10% of the best of hints 1/5/16/64 for their
# count; one row is ~20% slower than with hint 1 (and dense is faster still there).
PACKED_ROWS_HINT = 5

# The dual layout's split: dense up to this many rows (on the developer CPU dense is faster
# at 1 and 2 rows, packed from about 4; bench/results/cpu_weight_formats_matrix.json).
DUAL_DENSE_ROWS = 2

# oneDNN, and torch's ideep layer above it, cache one primitive per input shape (1024 of each by default), and a
# cached primitive keeps buffers about the size of its output (rows x out_features floats). Every new row count a
# packed layer meets (a verification's batch x (k+1), a prefill's prompt length) therefore costs memory that is
# never returned: 0.3-0.55 GB under load for the 1.5B target. Both caches are bounded: a forward meets 5 weight
# shapes, so 16 primitives hold the shapes of the last 3 row counts, and a miss costs one primitive creation, small
# beside a forward (bench/bench_packed_memory.py). Padding rows to a few counts would bound the shapes instead, but
# costs time on every verification.
ONEDNN_CACHE_CAPACITY = 16


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Both caches read their capacity once, at the process's first oneDNN primitive: this runs at import, before
    any model is loaded. An operator's own setting of either variable wins."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(capacity))


bound_onednn_caches()


def target_weight_request(requested: str, speculative: bool) -> str:
    """A target that only decodes (no draft) keeps "auto" dense: the fastest layout for one row at a time."""
    return "dense" if requested == "auto" and not speculative else requested


def resolve_weight_format(requested: str, role: str, device: torch.device, dtype: torch.dtype) -> str:
    if requested not in WEIGHT_FORMATS:
        raise InvalidArgument(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, not {requested!r}")
    if batch_invariant():
        if requested not in ("auto", "dense"):
            raise InvalidArgument(f"the {requested} weight format is not batch-invariant: --batch-invariant needs "
                                  f"dense weights (or auto)")
        return "dense"
    on_cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
    if requested == "auto":
        if not on_cpu_fp32:
            return "dense"
        if role == "draft" and _int8_available():
            return "int8"
        if role == "target" and torch.backends.mkldnn.is_available():
            return "packed"
        return "dense"
    if requested != "dense" and not on_cpu_fp32:
        raise InvalidArgument(f"the {requested} weight format needs float32 weights on the CPU")
    if requested in DRAFT_ONLY_FORMATS and role != "draft":
        raise InvalidArgument(f"{requested} weights would change the target's outputs; they are for drafts only")
    return requested


def use_weight_format(loaded, requested: str, role: str) -> str:
    """Resolve `requested` for this model and role and convert its layers once; returns the format in use. The dual
    layout maps its dense half from the model's checkpoint where it can (mapped_checkpoint)."""
    param = next(loaded.model.parameters())
    chosen = resolve_weight_format(requested, role, param.device, param.dtype)
    if chosen != loaded.weight_format:
        if loaded.weight_format != "dense":
            raise InvalidArgument(f"{loaded.name} already holds {loaded.weight_format} weights, cannot switch to {chosen}")
        apply_weight_format(loaded.model, chosen, mapped_checkpoint(loaded) if chosen == "dual" else None)
        loaded.weight_format = chosen
    return chosen


def mapped_checkpoint(loaded):
    """The model's float32 safetensors, mapped (mapped_weights.MappedCheckpoint), or None where it has none."""
    from pathlib import Path

    from specsplit.services.models.mapped_weights import MappedCheckpoint

    param = next(loaded.model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32 or not Path(loaded.path).is_dir():
        return None
    checkpoint = MappedCheckpoint(loaded.path)
    return checkpoint if len(checkpoint) else None


def apply_weight_format(model: nn.Module, weight_format: str, mapped=None) -> None:
    """Replace every nn.Linear under `model` (in place) with the format's version; dense leaves it as it is.
    `mapped`: for the dual layout, the checkpoint whose file holds the dense weights."""
    if weight_format == "dense":
        return
    if weight_format == "dual" and mapped is not None:
        def convert(linear, name):
            return DualLinear(linear, dense_parts=mapped.dense_parts(name, linear.weight))
    else:
        layout = LINEAR_LAYOUTS[weight_format]

        def convert(linear, name):
            return layout(linear)
    with torch.no_grad(), warnings.catch_warnings():
        # torch marks its quantized-tensor constructors as deprecated; they are still the int8 path it ships.
        warnings.simplefilter("ignore")
        _replace_linears(model, convert)


def _replace_linears(module: nn.Module, convert, prefix: str = "") -> None:
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if isinstance(child, nn.Linear):
            # the dense weight goes unless shared (a tied embedding keeps it)
            setattr(module, name, convert(child, qualified))
        else:
            _replace_linears(child, convert, qualified + ".")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight, PACKED_ROWS_HINT))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class Int8DynamicLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
        quantized = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self._packed = torch.ops.quantized.linear_prepack(quantized, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range=True keeps activations to 7 bits so fbgemm's int16 accumulation cannot saturate.
        return torch.ops.quantized.linear_dynamic(x, self._packed, True)


class Bf16Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.weight, self.bias).float()


# A mapped dense call that reads its weights slower than this has met pages the kernel dropped (memory pressure):
# they come back from disk, one-row steps would crawl at the disk's speed. Unless the calibration measured the
# machine's own rate (then an eighth of it: DualLinear.min_bytes_per_s), this floor; memory reads run at 5-30 GB/s
# on one or two cores.
MAPPED_MIN_BYTES_PER_S = 2e9
# A layer that met dropped pages runs its one-row steps packed for this many calls, then tries its mapped weights again
# (reading them back, which pays once memory has come free); twice as long after each try that finds them dropped
# again, up to MAPPED_MAX_BACKOFF times (each try reads the layer from disk).
MAPPED_RETRY_CALLS = 256
MAPPED_MAX_BACKOFF = 64
MAPPED_JUDGED_BYTES = 4 << 20  # layers whose weights are smaller are not judged by their calls' times


class DualLinear(nn.Module):
    """The dense weight and its packed copy: dense for calls of up to `dense_rows` rows, packed above.
    `dense_parts`: the dense weight as views of the mapped checkpoint (a fused layer's parts, in fusion order,
    whose stacked rows are the weight): then the process keeps no dense copy of its own, and a dense call that finds
    the file's pages dropped (slower than min_bytes_per_s) sends the layer's small calls to packed for a while
    (MAPPED_RETRY_CALLS calls, twice as long after each try that finds them dropped again)."""

    def __init__(self, linear: nn.Linear, dense_rows: int = DUAL_DENSE_ROWS,
                 dense_parts: list[torch.Tensor] | None = None, clock=time.perf_counter):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dense_rows = dense_rows
        self.dense_parts = dense_parts  # a plain attribute: module moves and state dicts leave the file alone
        self.dense_bytes = sum(p.numel() * p.element_size() for p in dense_parts) if dense_parts else 0
        self.judged = self.dense_bytes >= MAPPED_JUDGED_BYTES  # a small call's time is its overhead, not its reads
        self.min_bytes_per_s = MAPPED_MIN_BYTES_PER_S
        self.packed_calls_left = 0  # > 0: the mapped pages were found dropped; small calls run packed meanwhile
        self.backoff = 1  # the next wait's multiple of MAPPED_RETRY_CALLS
        self.clock = clock
        # The source's weight (shared with a tied embedding) unless the file holds it.
        self.register_buffer("weight", None if dense_parts else linear.weight.detach())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.packed = PackedLinear(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > self.dense_rows * self.in_features:
            return self.packed(x)
        if self.dense_parts is None:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if self.packed_calls_left > 0:
            self.packed_calls_left -= 1
            return self.packed(x)
        started = self.clock()
        biases = (None,) * len(self.dense_parts) if self.bias is None else self.bias.split(
            [p.shape[0] for p in self.dense_parts])
        outputs = [torch.nn.functional.linear(x, p, b) for p, b in zip(self.dense_parts, biases)]
        if self.judged and self.dense_bytes < self.min_bytes_per_s * (self.clock() - started):
            self.packed_calls_left = MAPPED_RETRY_CALLS * self.backoff
            self.backoff = min(2 * self.backoff, MAPPED_MAX_BACKOFF)
        else:
            self.backoff = 1
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def extra_bytes(model: nn.Module, weight_format: str, mapped=None) -> int:
    """Memory the dual layout holds beyond one layout: the dense weights it keeps beside their packed copies, less
    those `mapped` (a MappedCheckpoint) holds in its file and those an embedding keeps anyway (a tied head)."""
    if weight_format != "dual":
        return 0
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(m.weight.numel() * m.weight.element_size() for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and id(m.weight) not in embeddings
               and (mapped is None or mapped.dense_parts(name, m.weight) is None))


# How each non-dense format converts one nn.Linear (the source layer is left as it is).
LINEAR_LAYOUTS = {"packed": PackedLinear, "dual": DualLinear, "int8": Int8DynamicLinear, "bf16": Bf16Linear}


def _int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines
